"""Memory per device of a training step, term by term, from the model's shape.

Every term is bytes of tensors that exist, per device:

- weights: trainable weights in float32 (swiftlm keeps them so), frozen LoRA base weights in
  the compute dtype; DeepSpeed holds its module in the compute dtype plus a float32 master copy
  of the trained weights; ZeRO-3 and FSDP2 shard weights over the data-parallel ranks, tensor
  parallel splits the block projections, pipeline parallel the blocks;
- gradients: float32, one per trainable weight (sharded by ZeRO-2/3 and FSDP2);
- optimizer: AdamW's two float32 moments per trainable weight (sharded by every ZeRO and FSDP2);
- activations: what autograd saves per decoder layer per token (`activation_bytes_per_token`,
  the saved tensors of a Llama-style block under autocast), or only each layer's input with
  gradient checkpointing plus one layer recomputed in backward;
- logits: the fused, chunked cross-entropy's chunk (swiftlm's default) with the head weight's
  compute-dtype copy and float32 gradient it makes when the head trains, or the whole
  [tokens, vocab] logits, their float32 copy and gradient;
- buffers: DDP's gradient buckets, DeepSpeed's reduce bucket (and ZeRO-3's gathered weights
  it keeps live between forward and backward), FSDP2's gathered layers,
  autocast's low-precision copies of the trained weights, and the runtime baseline (the CPU
  probe's measured per-process memory before any model).

The peak is what stays (weights, optimizer, buffers) plus the larger of the two phases of a
step: forward/backward (activations, logits, weight casts, accumulated gradients) and the
optimizer step (gradients, one float32 temporary per trained weight of foreach AdamW); on
CPUs, or the loading of the model if that is higher.
"""

from dataclasses import dataclass, replace

from swiftlm.plan.devices import DeviceSpec
from swiftlm.plan.layouts import DDP, FSDP2, RING, ZERO1, ZERO3, Layout
from swiftlm.plan.shape import ModelShape

FP32 = 4
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb (the buckets together hold all gradients)
DEEPSPEED_BUCKET_ELEMENTS = 5e8  # reduce_bucket_size in the built-in zero*.json
DEEPSPEED_LIVE_ELEMENTS = 1e9  # ZeRO-3's stage3_max_live_parameters default
FUSED_CE_CHUNK_ELEMENTS = 2**24  # losses/chunked_ce.py: one chunk of float32 logits
FUSED_CE_MIN_ROWS = 64
# CPUs (glibc malloc): the forward's freed temporaries stay in the process's heap, between the
# tensors autograd saves, so the resident memory of a forward grows by this multiple of what
# it saves (measured on SmolLM2-135M: 1.70x for LoRA 4x512 tokens, 1.67x for 4x128, 1.6x for
# full 2x256; tests/slow/test_plan_accuracy.py). With checkpointing the recomputed blocks'
# temporaries leave this share of the un-checkpointed saved bytes (0.33x LoRA, 0.6x full).
CPU_HEAP_RETAINED = 1.7
CPU_HEAP_CHECKPOINTED = 0.4
# CPUs: oneDNN keeps a packed copy of each weight cast for its bf16 matmuls next to autocast's
# cast (a full SmolLM2 forward of 16 tokens grows by 0.62 GiB: twice 2 bytes per parameter).
CPU_CAST_COPIES = 2
# Ring attention's backward holds a chunk's scores, probabilities, their product with the
# values and the score gradient at once.
RING_SCORE_CHUNKS = 4


@dataclass(frozen=True)
class Job:
    """The training job a plan is for (per device micro-batch)."""

    batch_size: int
    max_length: int
    grad_accum: int = 1
    checkpointing: bool = False
    full: bool = False  # --train_type full (else LoRA/DoRA adapters)
    lora_rank: int = 8
    compute_bytes: int = 2  # bf16/fp16 autocast: 2; float32: 4
    fused_ce: bool = True

    @property
    def tokens(self) -> int:
        return self.batch_size * self.max_length


@dataclass(frozen=True)
class Memory:
    """Bytes per device; `peak` combines them by phase (see the module docstring)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    buffers: float  # persistent buffers and the runtime baseline
    cast_copies: float  # autocast's compute-dtype copies of trained weights (forward only)
    optimizer_temp: float  # foreach AdamW's float32 temporary at the step
    offloaded: float = 0.0  # bytes moved to host memory (GPU offload)
    loading: float = 0.0  # CPU: the process while it loads the model (before any sharding)

    @property
    def training(self) -> float:
        forward_backward = self.activations + self.logits + self.cast_copies
        step = self.gradients + self.optimizer_temp
        return self.weights + self.optimizer + self.buffers + max(forward_backward, step)

    @property
    def peak(self) -> float:
        return max(self.training, self.loading)


def activation_bytes_per_token(shape: ModelShape, job: Job, tp: int = 1) -> float:
    """Bytes autograd saves in one decoder block per token (Llama-style: RMSNorm, RoPE,
    fused attention without the score matrix, gated MLP). Counted tensor by tensor (and
    checked against autograd's saved-tensor hooks in tests/unit/test_plan.py): the norms save
    their float32 input and inverse RMS (and the normalized input when their weight trains);
    each trained projection saves its input (in autocast one cast per projection, in float32
    the shared norm output; LoRA: each adapter's A and B inputs); attention saves q, k, v,
    its output, the log-sum-exp and RoPE's cos/sin; the MLP its gate, up, activation and the
    down projection's input. Tensor parallel splits heads and the MLP width."""
    a, h = job.compute_bytes, shape.hidden_size
    kv, inter = shape.kv_size / tp, shape.intermediate_size / tp
    heads, q_width = shape.num_heads / tp, shape.num_heads * shape.head_dim / tp
    norms = 2 * (FP32 * h + FP32) + (2 * FP32 * h if job.full else 0)
    inputs = (5 if job.full else 6) * a * h if a < FP32 else 2 * FP32 * h
    adapters = 0 if job.full else 7 * a * job.lora_rank
    attention = 2 * a * q_width + 2 * a * kv + FP32 * heads + 2 * FP32 * shape.head_dim
    mlp = 4 * a * inter
    return norms + inputs + adapters + attention + mlp


def activation_bytes(shape: ModelShape, job: Job, layers: int, tp: int = 1, in_flight=1) -> float:
    """Saved activations of `layers` blocks for `in_flight` micro-batches (pipeline stages
    hold several), at the peak of backward."""
    per_token = activation_bytes_per_token(shape, job, tp)
    tokens = job.tokens * in_flight
    if job.checkpointing:  # each block keeps its input; backward recomputes one block at a time
        return tokens * layers * FP32 * shape.hidden_size + job.tokens * per_token
    return tokens * layers * per_token


def _cpu_heap_retained(shape: ModelShape, job: Job, layers: int, tp: int, in_flight) -> float:
    """The forward's freed temporaries that a CPU process keeps resident (see CPU_HEAP_*)."""
    saved = activation_bytes(shape, replace(job, checkpointing=False), layers, tp, in_flight)
    share = CPU_HEAP_CHECKPOINTED if job.checkpointing else CPU_HEAP_RETAINED - 1
    return share * saved


def _cpu_unsharded_blocks(shape: ModelShape, layout: Layout, job: Job, dp: int) -> float:
    """ZeRO-3 and FSDP2 on CPUs: every rank loaded the whole model before sharding it; the
    decoder blocks' weights it then frees are small allocations that glibc keeps in the heap
    under the live tensors (the embeddings and head, tens of MB each, are mapped on their own
    and go back to the system)."""
    blocks = shape.total_params - shape.embedding_params - shape.head_params
    loaded = FP32 if (job.full or job.compute_bytes == FP32) else job.compute_bytes
    return blocks / layout.tp / layout.pp * loaded * (1 - 1 / dp)


def logits_bytes(shape: ModelShape, job: Job) -> float:
    """The LM head's vocab-sized tensors at their peak, and the hidden-state gradient the
    fused loss keeps from forward to backward."""
    vocab = shape.vocab_size
    if job.fused_ce:
        rows = min(job.tokens, max(FUSED_CE_MIN_ROWS, FUSED_CE_CHUNK_ELEMENTS // vocab))
        # one chunk's logits, its softmax and the gradient made from it, all float32
        chunk = 3 * rows * vocab * FP32 + job.tokens * shape.hidden_size * FP32
        head = vocab * shape.hidden_size
        # the head weight cast once to the compute dtype (a trained head is float32), and
        # its float32 gradient accumulated over the chunks
        cast = head * job.compute_bytes if job.full and job.compute_bytes < FP32 else 0
        return chunk + cast + (head * FP32 if job.full else 0)
    return job.tokens * vocab * (job.compute_bytes + 2 * FP32)


def sequence_shard(job: Job, sp: int) -> Job:
    """The job one rank of a sequence-parallel group runs: ceil(T / sp) tokens of each row
    plus the look-ahead token that lends the next shard's first label
    (distributed/sequence_parallel.py); the job itself for sp = 1."""
    if sp == 1:
        return job
    return replace(job, max_length=-(-job.max_length // sp) + 1)


def residual_bytes(job: Job) -> int:
    """Bytes per element of the hidden states between blocks: float32 when the weights train
    in float32 (full; RoPE's cos/sin are made in it too, so q and k leave RoPE in float32),
    else the frozen base's compute dtype."""
    return FP32 if (job.full or job.compute_bytes == FP32) else job.compute_bytes


def ring_attention_bytes(shape: ModelShape, shard: Job, layers: int) -> float:
    """What ring attention (distributed/ring_attention.py, float32 whatever the dtype) holds
    beyond the fused attention `activation_bytes_per_token` counts: its saved output is
    float32 in every decoder block; and the working set of the one layer in backward: the
    float32 queries, output gradient and query gradient; the key/value shard held, its gradients and
    the same four arriving; the keys and values repeated to the query heads (GQA) and their
    gradients; and RING_SCORE_CHUNKS chunks of scores, each at most SCORE_ELEMENTS (queries are
    taken in chunks that small) and at most one block's [B, heads, L, L]."""
    from swiftlm.distributed.ring_attention import SCORE_ELEMENTS

    tokens = shard.tokens - shard.batch_size  # the look-ahead stays out of attention
    q, kv = shape.num_heads * shape.head_dim, shape.kv_size
    saved = (FP32 - shard.compute_bytes) * q * tokens * (1 if shard.checkpointing else layers)
    repeated = 2 * q if shape.num_heads != shape.num_kv_heads else 0
    working = FP32 * tokens * (3 * q + 8 * kv + repeated + 2 * q)
    length = shard.max_length - 1
    chunk = min(SCORE_ELEMENTS, shard.batch_size * shape.num_heads * length * length)
    return saved + working + FP32 * RING_SCORE_CHUNKS * chunk


def held_share(params: float, experts: float, share: int, ep: int) -> float:
    """Of `params` (`experts` of them expert weights), what one rank holds of a state split
    `share` ways over the data-parallel ranks (1: replicated). Expert parallel gives each
    rank 1/ep of the experts, and FSDP2 leaves those shards out of its units
    (distributed/expert_parallel.py), so they are 1/ep under DDP and FSDP2 alike."""
    return (params - experts) / share + experts / ep


def estimate_memory(shape: ModelShape, layout: Layout, job: Job, device: DeviceSpec) -> Memory:
    """The memory per device of `layout` (the most loaded device: pipeline stage 0)."""
    job = sequence_shard(job, layout.sp)
    trained, frozen = _split_parameters(shape, layout)
    expert_trained, expert_frozen = expert_weights(shape, layout, job)
    frozen_bytes = FP32 if (job.full or job.compute_bytes == FP32) else job.compute_bytes
    ranks, ep = layout.gradient_ranks, layout.ep  # SP's shards reduce with the replicas
    opt_share = ranks if layout.shards_optimizer else 1
    grad_share = ranks if layout.shards_gradients else 1
    weight_share = ranks if layout.shards_weights else 1
    held_trained = held_share(trained, expert_trained, weight_share, ep)
    held_frozen = held_share(frozen, expert_frozen, weight_share, ep)
    local = held_share(trained, expert_trained, 1, ep)  # the trained weights a rank computes
    bucketed = trained - expert_trained  # DDP leaves the expert shards to their all-reduce
    if layout.deepspeed:  # the engine's module in the compute dtype + a float32 master copy
        weights = (held_trained + held_frozen) * job.compute_bytes + FP32 * trained / ranks
    else:
        weights = held_trained * FP32 + held_frozen * frozen_bytes
    gradients = FP32 * held_share(trained, expert_trained, grad_share, ep)
    if layout.sharding == ZERO1:  # full low-precision gradients, reduced into the fp32 partition
        gradients = job.compute_bytes * trained + FP32 * trained / ranks
    optimized = held_share(trained, expert_trained, opt_share, ep)
    optimizer = 2 * FP32 * optimized
    offloaded = 0.0
    if layout.offload:
        offloaded = optimizer + (weights if layout.shards_weights else 0.0)
        optimizer, weights = 0.0, weights - (weights if layout.shards_weights else 0.0)
    layers = _layers_on_device(shape, layout)
    in_flight = min(layout.pp, job.grad_accum) if layout.pp > 1 else 1
    activations = activation_bytes(shape, job, layers, layout.tp, in_flight)
    if layout.sp > 1 and layout.sp_impl == RING:
        activations += ring_attention_bytes(shape, job, layers)
    if device.kind == "cpu":
        activations += _cpu_heap_retained(shape, job, layers, layout.tp, in_flight)
    cast_copies = 0.0
    gpu_fsdp2 = layout.sharding == FSDP2 and device.kind == "gpu"  # gathers in bf16 itself
    if job.compute_bytes < FP32 and not layout.deepspeed and not gpu_fsdp2:
        cast_copies = job.compute_bytes * local  # autocast caches casts of trained leaves
        if device.kind == "cpu":
            cast_copies *= CPU_CAST_COPIES
    if job.grad_accum > 1:
        activations += gradients  # earlier micro-batches' gradients stay during forward
    if device.kind == "cpu" and layout.shards_weights and ranks > 1:
        weights += _cpu_unsharded_blocks(shape, layout, job, ranks)
    return Memory(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        logits=logits_bytes(shape, job) if _holds_head(layout) else 0.0,
        buffers=_baseline(device, layout) + _comm_buffers(shape, layout, job, bucketed),
        cast_copies=cast_copies,
        optimizer_temp=0.0 if layout.offload else FP32 * optimized,
        offloaded=offloaded,
        loading=_loading(shape, job, device, layout),
    )


def expert_weights(shape: ModelShape, layout: Layout, job: Job) -> tuple[float, float]:
    """(trained, frozen) stacked expert weights on one device, the part expert parallel
    splits; LoRA's adapters on experts are counted with the replicated weights (small)."""
    if layout.ep == 1:
        return 0.0, 0.0
    return (shape.expert_params, 0.0) if job.full else (0.0, shape.expert_params)


def _split_parameters(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """(trained, frozen) parameters on one device before data-parallel sharding: tensor
    parallel splits the decoder blocks' weights, pipeline stage 0 holds its share of the
    blocks and the embeddings."""
    layers = _layers_on_device(shape, layout)
    outside = shape.embedding_params + shape.head_params + shape.hidden_size  # + final norm
    block_total = (shape.total_params - outside) / shape.num_layers
    full = shape.trainable_params == shape.total_params
    block_trained = block_total if full else shape.layer_trainable_params
    if layout.pp > 1:
        outside = shape.embedding_params  # stage 0: the embeddings, not the head
    total = outside + layers * block_total / layout.tp
    trained = (outside if full else 0) + layers * block_trained / layout.tp
    return trained, total - trained


def _layers_on_device(shape: ModelShape, layout: Layout) -> int:
    return -(-shape.num_layers // layout.pp)


def _loading(shape: ModelShape, job: Job, device: DeviceSpec, layout: Layout) -> float:
    """On CPUs every rank loads the whole model before any sharding: the weight files'
    pages are mapped, and weights converted to another dtype (LoRA's frozen base in bf16)
    are first read into float32 tensors, then cast (measured: ~1 GiB above the baseline for
    SmolLM2's float32 files loaded in bf16). GPUs load through host memory: not counted."""
    if device.kind != "cpu":
        return 0.0
    converted = not job.full and job.compute_bytes < FP32
    dtype_bytes = job.compute_bytes if converted else FP32
    materialized = shape.total_params * (FP32 + dtype_bytes if converted else 0)
    return _baseline(device, layout) + shape.checkpoint_bytes + materialized


def _baseline(device: DeviceSpec, layout: Layout) -> float:
    """The runtime's own memory per process (measured on CPUs; DeepSpeed adds its modules)."""
    if layout.deepspeed:
        return max(device.baseline_deepspeed_bytes, device.baseline_bytes)
    return device.baseline_bytes


def _holds_head(layout: Layout) -> bool:
    """Stage 0 is the planner's most loaded stage; with several stages the head is elsewhere."""
    return layout.pp == 1


def _comm_buffers(shape: ModelShape, layout: Layout, job: Job, trained: float) -> float:
    """`trained`: the trained weights whose gradients the engine reduces (not the expert
    shards, which expert parallel all-reduces over their replicas itself)."""
    if layout.gradient_ranks == 1:
        return 0.0
    if layout.sharding == DDP:  # DDP copies every gradient into its buckets
        return FP32 * trained + DDP_BUCKET_BYTES
    if layout.sharding == ZERO3:
        # the reduce bucket, and the gathered weights ZeRO-3 keeps live for reuse in backward
        # (stage3_max_live_parameters and stage3_max_reuse_distance: 1e9 elements by default)
        bucket = min(DEEPSPEED_BUCKET_ELEMENTS, trained)
        live = min(DEEPSPEED_LIVE_ELEMENTS, shape.total_params / layout.tp)
        return job.compute_bytes * (bucket + live)
    if layout.deepspeed:  # the reduce bucket is filled up to its size
        return job.compute_bytes * min(DEEPSPEED_BUCKET_ELEMENTS, trained)
    if layout.sharding == FSDP2:
        # the gathered weights of the block in use and the next one, and the root unit
        # (embeddings, head, final norm): gathered from forward to the end of backward, its
        # gradient whole until the reduce-scatter
        block = shape.total_params / shape.num_layers / layout.tp
        root = shape.embedding_params + shape.head_params + shape.hidden_size
        return 2 * block * FP32 + 2 * root * FP32
    return 0.0
