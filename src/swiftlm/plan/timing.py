"""Estimated time of one optimizer step over the same global batch for every layout (data
parallel's: micro-batch x devices x accumulation; tensor, pipeline and sequence parallel
layouts, with fewer replicas, accumulate more micro-batches to match): matmul work at the
device's FLOP rate, the optimizer's memory traffic at its memory bandwidth, and the
collectives' bytes at the link bandwidth (ring collectives: an all-reduce moves 2(n-1)/n of
the buffer per rank, an all-gather, reduce-scatter or all-to-all (n-1)/n), plus the link's
latency per collective. Sequence parallel adds its attention traffic (Ulysses' all-to-alls,
ring attention's key/value passes), expert parallel its token dispatch and combine.

Only a share of peak FLOP/s is reached in training: GPU_EFFICIENCY is the typical share of
dense bf16 peak in LLM training (an assumption, stated in `swiftlm plan`'s output); on CPUs
the probe measured the FLOP rate of one worker and CPU_EFFICIENCY is the share of it a
training step reaches at these model sizes, fitted by benchmarks/plan_accuracy.py.
"""

from dataclasses import dataclass, replace

from swiftlm.plan.devices import Cluster
from swiftlm.plan.layouts import DDP, FSDP2, RING, ULYSSES, ZERO3, Layout
from swiftlm.plan.memory import (
    DDP_BUCKET_BYTES,
    FP32,
    Job,
    expert_weights,
    held_share,
    residual_bytes,
    sequence_shard,
)
from swiftlm.plan.shape import ModelShape

GPU_EFFICIENCY = 0.45
CPU_EFFICIENCY = 0.08
# Bytes per trained parameter an AdamW step reads and writes: weight, gradient, two moments
# (read and write) and foreach's temporary.
ADAM_BYTES_PER_PARAM = 40
HOST_MEMORY_BANDWIDTH = 50e9  # offloaded optimizer steps run in host memory
# Share of DDP/FSDP2's collectives hidden behind backward on GPUs (NCCL runs on its own
# engines); on CPUs gloo needs the cores the backward runs on, so nothing is hidden.
OVERLAPPED = 0.5
# DeepSpeed's step also converts: low-precision gradients into the float32 partition, the
# updated partition back into the low-precision weights (bytes per trained parameter).
DEEPSPEED_CONVERT_BYTES = 12


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    optimizer_s: float
    communication_s: float  # exposed (not overlapped) collective time

    @property
    def total_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.communication_s


def flops_per_token(shape: ModelShape, job: Job) -> float:
    """Training FLOPs per token (the formula of monitor/mfu.py, from the shape): 2 per matmul
    weight forward plus causal attention, backward twice the forward when all weights train,
    else the forward (activation gradients) plus the adapters' weight gradients; checkpointing
    adds a forward. A mixture-of-experts token computes with its top_k experts only."""
    outside = shape.embedding_params + shape.head_params + shape.hidden_size
    outside += shape.idle_expert_params
    matmul = shape.total_params - outside + shape.vocab_size * shape.hidden_size  # + the head
    forward = 2 * matmul + 2 * shape.num_layers * shape.hidden_size * job.max_length
    backward = 2 * forward if job.full else forward + 2 * shape.trainable_params
    return forward + backward + (forward if job.checkpointing else 0)


def estimate_step_time(shape: ModelShape, layout: Layout, job: Job, cluster: Cluster) -> StepTime:
    device = cluster.device
    efficiency = GPU_EFFICIENCY if device.kind == "gpu" else CPU_EFFICIENCY
    rate = device.flops * efficiency
    # The same global batch for every layout: model-parallel layouts have fewer replicas,
    # so each accumulates tp * pp * sp times more micro-batches (split over those devices;
    # a sequence shard computes its ceil(T / sp) tokens and the look-ahead).
    accum = _equal_batch_accumulation(job, layout)
    tokens = sequence_shard(job, layout.sp).tokens
    per_token = flops_per_token(shape, job)
    if layout.sp > 1 and layout.sp_impl == RING:
        per_token += ring_attention_flops_per_token(shape, job)
    work = per_token * tokens * accum / (layout.tp * layout.pp)
    compute = work / rate
    if layout.pp > 1:  # 1F1B: the pipeline fills and drains around the micro-batches
        compute *= (accum + layout.pp - 1) / accum
    trained = shape.trainable_params / (layout.tp * layout.pp)
    share = layout.gradient_ranks if layout.shards_optimizer else 1
    per_rank = held_share(trained, expert_weights(shape, layout, job)[0], share, layout.ep)
    if layout.offload:
        optimizer = per_rank * ADAM_BYTES_PER_PARAM / HOST_MEMORY_BANDWIDTH
        optimizer += 2 * FP32 * per_rank / device.intra_bandwidth  # gradients out, weights back
    else:
        optimizer = per_rank * ADAM_BYTES_PER_PARAM / device.memory_bandwidth
    if layout.deepspeed:
        optimizer += trained * DEEPSPEED_CONVERT_BYTES / device.memory_bandwidth
    communication = _communication(shape, layout, job, cluster)
    communication += _sequence_parallel_s(shape, layout, job, cluster, rate)
    communication += _expert_parallel_s(shape, layout, job, cluster)
    return StepTime(compute, optimizer, communication)


def _equal_batch_accumulation(job: Job, layout: Layout) -> int:
    return job.grad_accum * layout.tp * layout.pp * layout.sp


def _collectives(shape: ModelShape, layout: Layout, job: Job) -> int:
    """Collectives per step, each paying the link's latency: DDP's 25 MB buckets, FSDP2's
    gather (forward and backward) and reduce-scatter per block, ZeRO-3's gathers per module
    with weights (forward and backward; ~9 per Llama block), ZeRO-1/2's buckets, TP's four
    all-reduces per block and micro-batch; per attention layer and micro-batch, the gather
    of positions and Ulysses' eight all-to-alls or ring attention's sp - 1 hops forward and
    sp backward; per MoE layer and micro-batch, expert parallel's all-to-all of expert
    counts and its four of rows, and its all-reduce of each expert shard per step."""
    layers = -(-shape.num_layers // layout.pp)
    accum = _equal_batch_accumulation(job, layout)
    count = 0
    if layout.gradient_ranks > 1:
        if layout.sharding == DDP:
            count = 1 + int(FP32 * shape.trainable_params // DDP_BUCKET_BYTES)
        elif layout.sharding == FSDP2:
            count = 3 * (layers + 1)
        elif layout.sharding == ZERO3:
            count = 2 * (9 * layers + 2) + 1
        else:
            count = 2
    if layout.tp > 1:
        count += 4 * layers * accum
    if layout.sp > 1:
        per_layer = 9 if layout.sp_impl == ULYSSES else 2 * layout.sp
        count += per_layer * layers * accum
    if layout.ep > 1:
        count += 5 * shape.moe_layers * accum + 2 * shape.moe_layers
    return count


def _communication(shape: ModelShape, layout: Layout, job: Job, cluster: Cluster) -> float:
    """The gradient (and sharded weight) collectives of data parallel, TP's and PP's
    activation traffic, and every collective's latency."""
    device, n = cluster.device, layout.gradient_ranks
    spans_nodes = cluster.nnodes > 1 and n > cluster.per_node // (layout.tp * layout.pp)
    bandwidth = device.inter_bandwidth if spans_nodes else device.intra_bandwidth
    trained = shape.trainable_params / (layout.tp * layout.pp)
    total = shape.total_params / (layout.tp * layout.pp)
    a = job.compute_bytes
    # Expert parallel's shards are reduced apart (`_expert_parallel_s`), the rest over all n.
    expert_trained = expert_weights(shape, layout, job)[0]
    experts = shape.expert_params if layout.ep > 1 else 0
    seconds = _data_parallel_s(
        layout, device, trained - expert_trained, total - experts, n, a, spans_nodes
    )
    seconds += _collectives(shape, layout, job) * device.collective_latency
    if layout.tp > 1:  # two all-reduces per block forward, two backward, inside the node
        ring = 2 * (layout.tp - 1) / layout.tp
        accum = _equal_batch_accumulation(job, layout)
        volume = 4 * shape.num_layers * job.tokens * shape.hidden_size * a * accum
        seconds += ring * volume / device.intra_bandwidth
    if layout.pp > 1:  # activations forward and their gradients backward, per micro-batch
        volume = 2 * job.tokens * shape.hidden_size * a * _equal_batch_accumulation(job, layout)
        seconds += volume / bandwidth
    return seconds


def _data_parallel_s(
    layout: Layout, device, trained: float, total: float, n: int, a: int, spans_nodes: bool
) -> float:
    """Seconds of the collectives that keep `n` replicas of `total` weights (`trained` of
    them trained) in step, after what overlaps backward."""
    if n == 1:
        return 0.0
    ring = (n - 1) / n
    all_reduce = device.bandwidth("all_reduce", spans_nodes)
    scatter = device.bandwidth("reduce_scatter", spans_nodes)
    gather = device.bandwidth("all_gather", spans_nodes)
    if layout.sharding == DDP:
        seconds = 2 * ring * FP32 * trained / all_reduce
    elif layout.sharding == FSDP2:  # gather per block forward and backward, scatter grads
        gathered = a if device.kind == "gpu" else FP32  # CPU: no low-precision params
        seconds = ring * (2 * gathered * total / gather + FP32 * trained / scatter)
    elif layout.sharding == ZERO3:
        seconds = ring * (2 * a * total / gather + a * trained / scatter)
    else:  # ZeRO-1/2: reduce-scatter gradients, all-gather updated weights
        seconds = ring * a * trained * (1 / scatter + 1 / gather)
    if layout.sharding in (DDP, FSDP2) and device.kind == "gpu":
        seconds *= 1 - OVERLAPPED
    return seconds


def ulysses_bytes(shape: ModelShape, job: Job, sp: int) -> float:
    """Bytes one rank sends per micro-batch in Ulysses' all-to-alls: per attention layer, q,
    k and v from sequence shards to head shards and the output back (four forward, their
    gradients the same four ways in backward), each sending (sp - 1) / sp of the shard's
    tensor (ceil(T / sp) tokens: the look-ahead stays out of attention). q and k leave RoPE
    in the residual stream's dtype, v and the output are in the compute dtype."""
    tokens = job.batch_size * -(-job.max_length // sp)
    q, kv, a = shape.num_heads * shape.head_dim, shape.kv_size, job.compute_bytes
    per_token = (q + kv) * residual_bytes(job) + (kv + q) * a
    return 2 * shape.num_layers * tokens * per_token * (sp - 1) / sp


def ring_bytes(shape: ModelShape, job: Job, sp: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per micro-batch in ring attention, all float32
    (distributed/ring_attention.py): per layer, sp - 1 hops of its shard's keys and values
    forward; in backward sp - 1 hops of keys and values with their gradients, and one more of
    the gradients alone, which arrive home after the sp-th hop."""
    kv = job.batch_size * -(-job.max_length // sp) * shape.kv_size * shape.num_layers * FP32
    return 2 * kv * (sp - 1), 4 * kv * (sp - 1) + 2 * kv


def _sequence_parallel_s(
    shape: ModelShape, layout: Layout, job: Job, cluster: Cluster, rate: float
) -> float:
    """Seconds of sequence parallel's attention traffic per step. Ulysses' all-to-alls sit
    between the projections and attention: nothing hides them. Ring attention's forward sends
    the next key/value shard while it attends the one it holds, so on GPUs the sp - 1 hops
    hide behind as many blocks of attention (a block: the shard's queries against one key
    shard, computed whole); its backward waits for each hop, and gloo needs the cores the
    attention runs on: nothing is hidden there or on CPUs."""
    if layout.sp == 1:
        return 0.0
    device, sp = cluster.device, layout.sp
    spans_nodes = cluster.nnodes > 1 and sp * layout.tp > cluster.per_node
    accum = _equal_batch_accumulation(job, layout)
    if layout.sp_impl == ULYSSES:
        return accum * ulysses_bytes(shape, job, sp) / device.bandwidth("all_to_all", spans_nodes)
    forward, backward = ring_bytes(shape, job, sp)
    bandwidth = device.bandwidth("all_gather", spans_nodes)  # a ring all-gather's N - 1 hops
    if device.kind == "gpu":
        length = -(-job.max_length // sp)
        q_width = shape.num_heads * shape.head_dim
        block = 4 * job.batch_size * length**2 * q_width * shape.num_layers / rate  # QK^T, PV
        return accum * (max(0.0, forward / bandwidth - (sp - 1) * block) + backward / bandwidth)
    return accum * (forward + backward) / bandwidth


def ring_attention_flops_per_token(shape: ModelShape, job: Job) -> float:
    """The attention work ring attention adds per token: its shards are contiguous, so the
    last rank attends its queries to every earlier shard and computes the diagonal block
    whole, as if attention were not causal, and the group waits for it: twice the causal
    attention that `flops_per_token` counts (its only term that grows with the length)."""
    return flops_per_token(shape, job) - flops_per_token(shape, replace(job, max_length=0))


def expert_all_to_all_bytes(shape: ModelShape, job: Job, ep: int) -> float:
    """Bytes one rank sends per micro-batch in expert parallel's all-to-alls: per MoE layer,
    each token's top_k rows dispatched to their experts' ranks and the outputs combined back,
    forward, and their gradients in backward (four), hidden-sized rows in the residual
    stream's dtype, (ep - 1) / ep of them to other ranks (routing taken as balanced)."""
    routed = job.tokens * shape.experts_per_token * shape.hidden_size * residual_bytes(job)
    return 4 * shape.moe_layers * routed * (ep - 1) / ep


def _expert_parallel_s(shape: ModelShape, layout: Layout, job: Job, cluster: Cluster) -> float:
    """Seconds of expert parallel per step: the all-to-alls, on the path from the router to
    the experts and back, so nothing hides them; and the expert shards' float32 gradients
    all-reduced over the dp / ep replicas holding the same shard, after backward (not
    overlapped by DDP, which leaves the shards alone)."""
    if layout.ep == 1:
        return 0.0
    device, ep = cluster.device, layout.ep
    spans_nodes = cluster.nnodes > 1 and ep > cluster.per_node
    dispatch = expert_all_to_all_bytes(shape, job, ep) / device.bandwidth("all_to_all", spans_nodes)
    replicas = layout.dp // ep
    if replicas == 1 or not job.full:  # frozen experts (attention-only LoRA) have no gradient
        return job.grad_accum * dispatch
    replicas_span = cluster.nnodes > 1 and layout.dp > cluster.per_node
    shard = FP32 * shape.expert_params / ep
    ring = 2 * (replicas - 1) / replicas
    return job.grad_accum * dispatch + ring * shard / device.bandwidth("all_reduce", replicas_span)
