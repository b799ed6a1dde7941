"""Estimated time of one optimizer step over the same global batch for every layout (data
parallel's: micro-batch x devices x accumulation; tensor and pipeline parallel layouts, with
fewer replicas, accumulate more micro-batches to match): matmul work at the device's FLOP rate,
the optimizer's memory traffic at its memory bandwidth, and the collectives' bytes at the
link bandwidth (ring collectives: an all-reduce moves 2(n-1)/n of the buffer per rank, an
all-gather or reduce-scatter (n-1)/n), plus the link's latency per collective.

Only a share of peak FLOP/s is reached in training: GPU_EFFICIENCY is the typical share of
dense bf16 peak in LLM training (an assumption, stated in `swiftlm plan`'s output); on CPUs
the probe measured the FLOP rate of one worker and CPU_EFFICIENCY is the share of it a
training step reaches at these model sizes, fitted by benchmarks/plan_accuracy.py.
"""

from dataclasses import dataclass

from swiftlm.plan.devices import Cluster
from swiftlm.plan.layouts import DDP, FSDP2, ZERO3, Layout
from swiftlm.plan.memory import DDP_BUCKET_BYTES, FP32, Job
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
    # so each accumulates tp * pp times more micro-batches (split over tp * pp devices).
    accum = _equal_batch_accumulation(job, layout)
    work = flops_per_token(shape, job) * job.tokens * accum / (layout.tp * layout.pp)
    compute = work / rate
    if layout.pp > 1:  # 1F1B: the pipeline fills and drains around the micro-batches
        compute *= (accum + layout.pp - 1) / accum
    trained = shape.trainable_params / (layout.tp * layout.pp)
    per_rank = trained / (layout.dp if layout.shards_optimizer else 1)
    if layout.offload:
        optimizer = per_rank * ADAM_BYTES_PER_PARAM / HOST_MEMORY_BANDWIDTH
        optimizer += 2 * FP32 * per_rank / device.intra_bandwidth  # gradients out, weights back
    else:
        optimizer = per_rank * ADAM_BYTES_PER_PARAM / device.memory_bandwidth
    if layout.deepspeed:
        optimizer += trained * DEEPSPEED_CONVERT_BYTES / device.memory_bandwidth
    return StepTime(compute, optimizer, _communication(shape, layout, job, cluster))


def _equal_batch_accumulation(job: Job, layout: Layout) -> int:
    return job.grad_accum * layout.tp * layout.pp


def _collectives(shape: ModelShape, layout: Layout, job: Job) -> int:
    """Collectives per step, each paying the link's latency: DDP's 25 MB buckets, FSDP2's
    gather (forward and backward) and reduce-scatter per block, ZeRO-3's gathers per module
    with weights (forward and backward; ~9 per Llama block), ZeRO-1/2's buckets, TP's four
    all-reduces per block and micro-batch."""
    layers = -(-shape.num_layers // layout.pp)
    count = 0
    if layout.dp > 1:
        if layout.sharding == DDP:
            count = 1 + int(FP32 * shape.trainable_params // DDP_BUCKET_BYTES)
        elif layout.sharding == FSDP2:
            count = 3 * (layers + 1)
        elif layout.sharding == ZERO3:
            count = 2 * (9 * layers + 2) + 1
        else:
            count = 2
    if layout.tp > 1:
        count += 4 * layers * _equal_batch_accumulation(job, layout)
    return count


def _communication(shape: ModelShape, layout: Layout, job: Job, cluster: Cluster) -> float:
    device, n = cluster.device, layout.dp
    spans_nodes = cluster.nnodes > 1 and n > cluster.per_node // (layout.tp * layout.pp)
    bandwidth = device.inter_bandwidth if spans_nodes else device.intra_bandwidth
    trained = shape.trainable_params / (layout.tp * layout.pp)
    total = shape.total_params / (layout.tp * layout.pp)
    a = job.compute_bytes
    seconds = 0.0
    if n > 1:
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
