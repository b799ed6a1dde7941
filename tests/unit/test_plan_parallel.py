"""The planner's sequence parallel (Ulysses and ring) and expert parallel: memory per rank and
the traffic in step time, against formulas written out by hand, and where the layouts apply."""

from dataclasses import replace

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from swiftlm.plan.devices import Cluster, parse_devices
from swiftlm.plan.layouts import DDP, FSDP2, RING, ULYSSES, Layout, candidate_layouts
from swiftlm.plan.memory import (
    DDP_BUCKET_BYTES,
    Job,
    activation_bytes,
    estimate_memory,
    logits_bytes,
    sequence_shard,
)
from swiftlm.plan.shape import model_shape
from swiftlm.plan.timing import (
    _expert_parallel_s,
    _sequence_parallel_s,
    expert_all_to_all_bytes,
    ring_bytes,
    ulysses_bytes,
)
from swiftlm.tuners.config import TunerArguments

GPU = parse_devices("8xA100-80G").device
FULL = TunerArguments(train_type="full")


@pytest.fixture(scope="module")
def dense():
    """8 heads, 2 key/value heads: Ulysses splits 2 ways, not 4."""
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    return model_shape(config, FULL, "dense")


@pytest.fixture(scope="module")
def moe():
    config = Qwen3MoeConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return model_shape(config, FULL, "moe")


def test_a_sequence_shard_holds_ceil_t_over_n_tokens_and_the_look_ahead():
    job = Job(2, 1001, full=True)
    assert sequence_shard(job, 1) is job
    assert sequence_shard(job, 2).max_length == 501 + 1
    assert sequence_shard(job, 4).tokens == 2 * (251 + 1)


def test_sequence_parallel_activations_and_logits_per_rank_shrink_n_fold(dense):
    job = Job(2, 4096, full=True, fused_ce=False)
    one = estimate_memory(dense, Layout(DDP, 2), job, GPU)
    sp2 = estimate_memory(dense, Layout(DDP, 1, sp=2), job, GPU)
    # half of one process's tokens, plus the look-ahead token of each row
    share = (4096 // 2 + 1) / 4096
    assert sp2.activations == pytest.approx(one.activations * share)
    assert sp2.activations == pytest.approx(
        activation_bytes(dense, replace(job, max_length=2049), dense.num_layers)
    )
    # unfused logits: [tokens, vocab] in the compute dtype and two float32 copies
    assert sp2.logits == pytest.approx(2 * 2049 * 1000 * (2 + 8))
    assert sp2.logits == pytest.approx(one.logits * share)
    # weights, gradients and optimizer replicated over the group, as under DDP
    assert (sp2.weights, sp2.gradients, sp2.optimizer) == (
        one.weights,
        one.gradients,
        one.optimizer,
    )
    # FSDP2 shards over the replicas and the sequence shards together (dp x sp)
    fsdp = estimate_memory(dense, Layout(FSDP2, 2, sp=2), job, GPU)
    assert fsdp.weights == pytest.approx(4 * dense.total_params / 4)
    assert fsdp.optimizer == pytest.approx(one.optimizer / 4)


def test_ring_attention_holds_its_float32_working_set(dense):
    job = Job(1, 1024, full=True)  # bf16 compute
    ulysses = estimate_memory(dense, Layout(DDP, 1, sp=2), job, GPU)
    ring = estimate_memory(dense, Layout(DDP, 1, sp=2, sp_impl=RING), job, GPU)
    tokens, q, kv = 512, 8 * 32, 2 * 32
    saved = (4 - 2) * q * tokens * dense.num_layers  # its output saved in float32
    working = 4 * tokens * (3 * q + 8 * kv + 2 * q + 2 * q)  # GQA: k, v repeated to 8 heads
    scores = 4 * 4 * (8 * tokens * tokens)  # four chunks of one block's [heads, L, L]
    assert ring.activations - ulysses.activations == pytest.approx(saved + working + scores)


def test_ulysses_all_to_all_bytes(dense):
    full = Job(2, 1000, full=True)  # q and k float32 (RoPE in the residual dtype), v, out bf16
    tokens, q, kv = 2 * 500, 8 * 32, 2 * 32
    per_layer = tokens * ((q + kv) * 4 + (kv + q) * 2) * (2 - 1) / 2
    assert ulysses_bytes(dense, full, 2) == pytest.approx(2 * dense.num_layers * per_layer)
    lora = replace(full, full=False)  # a bf16 base: everything in bf16
    assert ulysses_bytes(dense, lora, 2) == pytest.approx(
        2 * dense.num_layers * tokens * 2 * (q + kv) * 2 / 2
    )


def test_ring_bytes_pass_keys_values_and_their_gradients(dense):
    job = Job(1, 4096, full=True)
    kv = 1024 * 2 * 32 * 4 * dense.num_layers  # one shard's keys, float32, all layers
    forward, backward = ring_bytes(dense, job, 4)
    assert forward == pytest.approx(3 * 2 * kv)
    assert backward == pytest.approx(3 * 4 * kv + 2 * kv)


def test_sequence_parallel_traffic_in_step_time(dense):
    job = Job(1, 4096, full=True, grad_accum=2)
    cluster = Cluster(GPU, 8)
    ulysses = Layout(DDP, 4, sp=2)
    accum = 2 * 2  # the same global batch: each replica accumulates sp times more
    expected = accum * ulysses_bytes(dense, job, 2) / GPU.intra_bandwidth
    assert _sequence_parallel_s(dense, ulysses, job, cluster, 1e14) == pytest.approx(expected)
    # ring on a CPU: nothing hides the hops
    cpu = replace(GPU, kind="cpu", allgather_bandwidth=1e9)
    ring = Layout(DDP, 4, sp=2, sp_impl=RING)
    forward, backward = ring_bytes(dense, job, 2)
    seconds = _sequence_parallel_s(dense, ring, job, Cluster(cpu, 8), 1e12)
    assert seconds == pytest.approx(accum * (forward + backward) / 1e9)
    # on a GPU the forward hops hide behind the attention of as many blocks (slow here),
    # unless that attention takes no time; backward waits for every hop
    hidden = _sequence_parallel_s(dense, ring, job, cluster, 1.0)
    assert hidden == pytest.approx(accum * backward / GPU.intra_bandwidth)
    exposed = _sequence_parallel_s(dense, ring, job, cluster, 1e30)
    assert exposed == pytest.approx(accum * (forward + backward) / GPU.intra_bandwidth)


def test_expert_parallel_divides_the_experts_state_per_rank(moe):
    job = Job(2, 256, full=True)
    experts = moe.expert_params
    assert experts == 3 * 8 * (128 * 2 * 64 + 64 * 128)  # gate_up [2 x 64, 128], down [128, 64]
    ddp = estimate_memory(moe, Layout(DDP, 4), job, GPU)
    ep2 = estimate_memory(moe, Layout(DDP, 4, ep=2), job, GPU)
    held = moe.total_params - experts + experts / 2
    assert ep2.weights == pytest.approx(4 * held)
    assert ep2.gradients == pytest.approx(4 * held)
    assert ep2.optimizer == pytest.approx(8 * held)
    # DDP's buckets hold only the replicated gradients; the shards are reduced apart
    assert ep2.buffers == pytest.approx(4 * (moe.total_params - experts) + DDP_BUCKET_BYTES)
    assert ep2.activations == ddp.activations and ep2.logits == ddp.logits
    assert ddp.weights == pytest.approx(4 * moe.total_params)


def test_expert_parallel_all_to_all_bytes_and_step_time(moe):
    job = Job(2, 256, full=True)
    # dispatch and combine, forward and backward, tokens x top_k rows of float32 hidden states
    expected = 4 * 3 * (2 * 256) * 2 * 128 * 4 * (4 - 1) / 4
    assert expert_all_to_all_bytes(moe, job, 4) == pytest.approx(expected)
    cluster = Cluster(GPU, 8)
    seconds = _expert_parallel_s(moe, Layout(DDP, 8, ep=4), job, cluster)
    shard_reduce = 2 * (2 - 1) / 2 * 4 * moe.expert_params / 4  # over dp / ep = 2 replicas
    assert seconds == pytest.approx((expected + shard_reduce) / GPU.intra_bandwidth)


def test_sequence_parallel_layouts_only_where_they_apply(dense):
    layouts, skipped = candidate_layouts(8, 8, dense, grad_accum=1, gpu=True)
    sp = [layout for layout in layouts if layout.sp > 1]
    ulysses = {layout.sp for layout in sp if layout.sp_impl == ULYSSES}
    assert ulysses == {2}  # 2 key/value heads
    assert {layout.sp for layout in sp if layout.sp_impl == RING} == {2, 4, 8}
    assert all(layout.sharding in (DDP, FSDP2) and layout.tp * layout.pp == 1 for layout in sp)
    assert all(layout.world == 8 for layout in layouts)
    assert not any(layout.ep > 1 for layout in layouts)  # a dense model: no EP, nothing said
    assert not any(name.startswith("EP") for name, _ in skipped)


def test_expert_parallel_layouts_only_where_they_apply(moe):
    layouts, skipped = candidate_layouts(6, 6, moe, grad_accum=1, gpu=True)
    ep = [layout for layout in layouts if layout.ep > 1]
    found = {(layout.ep, layout.sharding, layout.dp, layout.sp) for layout in ep}
    assert found == {(2, DDP, 6, 1), (2, FSDP2, 6, 1)}
    assert "8 experts are not divisible by 3" in dict(skipped)["EP3"]
    assert [layout.name for layout in ep] == ["DDP + EP2", "FSDP2 + EP2"]
    assert ep[0].sft_flags() == ["--expert_parallel_size", "2", "--strategy", "ddp"]
    assert ep[1].sft_flags() == ["--expert_parallel_size", "2", "--fsdp", "fsdp2"]
    lora = replace(moe, adapted_experts=True)  # peft's LoRA on the stacked experts
    layouts, skipped = candidate_layouts(4, 4, lora, grad_accum=1, gpu=True)
    assert not any(layout.ep > 1 for layout in layouts)
    assert "cannot be split" in dict(skipped)["EP"]


def test_sequence_parallel_flags(dense):
    assert Layout(DDP, 2, sp=2).sft_flags() == [
        "--sequence_parallel_size",
        "2",
        "--strategy",
        "ddp",
    ]
    ring = Layout(FSDP2, 1, sp=4, sp_impl=RING)
    assert ring.name == "SP4 ring x FSDP2"
    assert ring.sft_flags() == [
        "--sequence_parallel_size",
        "4",
        "--sequence_parallel_impl",
        "ring",
        "--fsdp",
        "fsdp2",
    ]
    assert ring.sharding_flags() == ["--fsdp", "fsdp2"]


def test_logits_per_rank_under_fused_cross_entropy_keep_the_head(dense):
    """The fused loss's token-sized part shrinks with the shard; the head's weight copy and
    gradient do not."""
    job = Job(1, 8192, full=True)
    shard = sequence_shard(job, 4)
    head = 1000 * 256 * (2 + 4)
    assert logits_bytes(dense, shard) - head == pytest.approx(
        3 * min(shard.tokens, 2**24 // 1000) * 1000 * 4 + shard.tokens * 256 * 4
    )


def test_expert_parallel_step_reduces_only_the_replicated_gradients_with_ddp(moe):
    """DDP all-reduces the replicated weights' gradients (half hidden behind backward on
    GPUs); the expert shards are reduced once, apart, over their replicas."""
    from swiftlm.plan.timing import OVERLAPPED, _collectives, estimate_step_time

    job, cluster, layout = Job(2, 256, full=True), Cluster(GPU, 8), Layout(DDP, 8, ep=2)
    replicated = moe.total_params - moe.expert_params
    ddp = 2 * 7 / 8 * 4 * replicated / GPU.intra_bandwidth * (1 - OVERLAPPED)
    latency = _collectives(moe, layout, job) * GPU.collective_latency
    expected = ddp + latency + _expert_parallel_s(moe, layout, job, cluster)
    assert estimate_step_time(moe, layout, job, cluster).communication_s == pytest.approx(expected)
