"""The planner's pieces: exact parameter counts from a config, the memory terms, device parsing
and what it says when nothing fits."""

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from swiftlm.errors import ConfigError
from swiftlm.plan.devices import GIB, parse_devices
from swiftlm.plan.layouts import DDP, FSDP2, ZERO2, ZERO3, Layout, candidate_layouts
from swiftlm.plan.memory import Job, activation_bytes, activation_bytes_per_token, estimate_memory
from swiftlm.plan.planner import TIE_TOLERANCE, make_plan
from swiftlm.plan.shape import model_shape
from swiftlm.tuners.config import TunerArguments

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def real_model(config, tuner: TunerArguments):
    from transformers import AutoModelForCausalLM

    from swiftlm.tuners.setup import apply_tuner

    torch.manual_seed(0)
    return apply_tuner(AutoModelForCausalLM.from_config(config), tuner)


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config])
@pytest.mark.parametrize("train_type", ["full", "lora"])
@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_from_the_config_equal_the_real_model(config_cls, train_type, tie):
    config = config_cls(**TINY, tie_word_embeddings=tie)
    tuner = TunerArguments(train_type=train_type, lora_rank=4)
    shape = model_shape(config, tuner, "tiny")
    model = real_model(config, tuner)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # the blocks, embeddings, head and final norm add up to the base model
    base = shape.embedding_params + shape.head_params + 64 + 2 * shape.layer_params
    assert base == sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)


def saved_bytes(config, tuner: TunerArguments, dtype: torch.dtype, tokens: int) -> float:
    """What autograd saves in the first decoder block, measured with saved-tensor hooks."""
    model = real_model(config, tuner)
    if tuner.train_type != "full" and dtype != torch.float32:
        for _name, param in model.named_parameters():  # swiftlm loads frozen weights in bf16
            if not param.requires_grad:
                param.data = param.data.to(dtype)
    base = model.get_base_model() if tuner.train_type != "full" else model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    hidden = torch.randn(1, tokens, config.hidden_size, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rotary = base.model.rotary_emb(hidden, positions)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        base.model.layers[0](hidden, position_embeddings=rotary, position_ids=positions)
    seen[hidden.untyped_storage().data_ptr()] = hidden.numel() * 4  # the block's input counts
    return sum(seen.values())


def saved_bytes_per_token(config, tuner: TunerArguments, dtype: torch.dtype) -> float:
    """The slope over the token count: autocast's weight copies are the same at any length."""
    return (saved_bytes(config, tuner, dtype, 128) - saved_bytes(config, tuner, dtype, 64)) / 64


@pytest.mark.parametrize(
    "train_type,dtype",
    [
        ("full", torch.bfloat16),
        ("lora", torch.bfloat16),
        ("full", torch.float32),
        ("lora", torch.float32),
    ],
)
def test_activation_bytes_per_token_equal_what_autograd_saves(train_type, dtype):
    config = LlamaConfig(**TINY)
    tuner = TunerArguments(train_type=train_type, lora_rank=4, lora_dropout=0.0)
    shape = model_shape(config, tuner, "tiny")
    job = Job(1, 64, full=train_type == "full", lora_rank=4, compute_bytes=dtype.itemsize)
    measured = saved_bytes_per_token(config, tuner, dtype)
    assert activation_bytes_per_token(shape, job) == pytest.approx(measured, rel=0.03)


@pytest.fixture(scope="module")
def smol_like():
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    return model_shape(config, TunerArguments(train_type="full"), "smol")


def test_zero3_shards_weights_over_the_data_parallel_ranks(smol_like):
    cpu = parse_devices("4xA100-80G").device
    job = Job(2, 256, full=True)
    ddp = estimate_memory(smol_like, Layout(DDP, 4), job, cpu)
    for n in (2, 4, 8):
        zero3 = estimate_memory(smol_like, Layout(ZERO3, n), job, cpu)
        # DeepSpeed: bf16 module + fp32 master, both 1/N; DDP: the fp32 weights whole
        assert zero3.weights == pytest.approx(smol_like.total_params * 6 / n)
        assert zero3.optimizer == pytest.approx(ddp.optimizer / n)
    zero2 = estimate_memory(smol_like, Layout(ZERO2, 4), job, cpu)
    assert zero2.gradients == pytest.approx(ddp.gradients / 4)
    assert zero2.weights > estimate_memory(smol_like, Layout(ZERO3, 4), job, cpu).weights
    fsdp2 = estimate_memory(smol_like, Layout(FSDP2, 4), job, cpu)
    assert fsdp2.weights == pytest.approx(ddp.weights / 4)


def test_gradient_checkpointing_lowers_activations(smol_like):
    plain, ckpt = Job(8, 2048, full=True), Job(8, 2048, full=True, checkpointing=True)
    layers = smol_like.num_layers
    assert (
        activation_bytes(smol_like, ckpt, layers) < activation_bytes(smol_like, plain, layers) / 5
    )
    # each block keeps only its float32 input, plus one block recomputed at a time
    expected = 8 * 2048 * (layers * 4 * 576 + activation_bytes_per_token(smol_like, ckpt))
    assert activation_bytes(smol_like, ckpt, layers) == pytest.approx(expected)


def test_device_strings_parse():
    cluster = parse_devices("8xH100", nnodes=2)
    assert (cluster.per_node, cluster.nnodes, cluster.world_size) == (8, 2, 16)
    assert cluster.device.memory_bytes == 80e9 and cluster.device.flops == 989e12
    assert parse_devices("A100").per_node == 1
    assert parse_devices("4xa100-40g").device.memory_bytes == 40e9
    assert parse_devices("2xL40S", memory_gib=10).device.memory_bytes == 10 * GIB


@pytest.mark.bad_input(
    input="swiftlm plan --devices with an unknown device or no count (8xB300, 0xH100)",
    outcome="A config error naming --devices, the value, the COUNTxDEVICE form and the known devices",
)
@pytest.mark.parametrize("value", ["8xB300", "0xH100", "eight"])
def test_a_bad_devices_value_names_the_flag_and_the_known_devices(value):
    with pytest.raises(ConfigError, match=r"--devices .*(H100.*MI300X.*cpu|at least 1)"):
        parse_devices(value)


def test_layouts_left_out_say_why(smol_like):
    layouts, skipped = candidate_layouts(8, 8, smol_like, grad_accum=1, gpu=True)
    names = {layout.name for layout in layouts}
    assert {"DDP", "ZeRO-3", "ZeRO-3 + offload", "FSDP2"} <= names
    reasons = dict(skipped)
    assert "divisible by 2" in reasons["TP2"] and "ties its embeddings" in reasons["PP2"]


def test_a_model_that_fits_nowhere_says_so_and_names_the_smallest_change(smol_like):
    cluster = parse_devices("2xL4", memory_gib=1.2)
    plan = make_plan(smol_like, Job(16, 4096, full=True), cluster)
    assert plan.best is None
    assert plan.change.startswith("--gradient_checkpointing true")
    assert "fits at" in plan.change
    hopeless = make_plan(smol_like, Job(1, 128, full=True), parse_devices("1xL4", memory_gib=0.8))
    assert hopeless.best is None and "L4" in hopeless.change and "fits at" in hopeless.change


def test_the_fastest_fitting_layout_is_recommended(smol_like):
    roomy = make_plan(smol_like, Job(2, 512, full=True), parse_devices("8xH100"))
    fitting = roomy.fitting
    fastest = min(c.time.total_s for c in fitting)
    assert roomy.best is fitting[0] and roomy.best.time.total_s <= fastest * (1 + TIE_TOLERANCE)
    # near-ties go to the simplest layout: nothing simpler is as fast
    simpler = [c for c in fitting if c.layout.tp * c.layout.pp == 1 and c.layout.sharding == DDP]
    if simpler and simpler[0].time.total_s <= fastest * (1 + TIE_TOLERANCE):
        assert roomy.best.layout.sharding == DDP
    # squeezed: layouts that replicate the optimizer no longer fit, a sharded one is chosen
    tight = make_plan(smol_like, Job(2, 512, full=True), parse_devices("8xH100", memory_gib=2))
    assert tight.best is not None and tight.best.layout.shards_optimizer
    assert not next(c for c in tight.candidates if c.layout.name == "DDP").fits


def test_slower_gloo_scatter_and_gather_make_sharded_layouts_slower_on_cpus(smol_like):
    """The probe's reduce-scatter and all-gather bandwidths price FSDP2 and ZeRO; DDP's
    all-reduce is unchanged (the numbers are this machine's probe, rounded)."""
    from dataclasses import replace

    from swiftlm.plan.devices import Cluster, DeviceSpec
    from swiftlm.plan.timing import estimate_step_time

    cpu = DeviceSpec("cpu", "cpu", 1.7e12, 12e9, 22e9, "gloo", 1.3e9, "eth", 1.25e9)
    slow = replace(cpu, reduce_scatter_bandwidth=0.4e9, allgather_bandwidth=0.5e9)
    job = Job(2, 256, full=True)
    for layout in (Layout(DDP, 2), Layout(FSDP2, 2), Layout(ZERO2, 2), Layout(ZERO3, 2)):
        same = estimate_step_time(smol_like, layout, job, Cluster(cpu, 2))
        slower = estimate_step_time(smol_like, layout, job, Cluster(slow, 2))
        if layout.sharding == DDP:
            assert slower == same
        else:
            assert slower.communication_s > same.communication_s * 2
    # FSDP2 on gloo: two float32 all-gathers of the weights and a reduce-scatter of the grads
    fsdp2 = estimate_step_time(smol_like, Layout(FSDP2, 2), job, Cluster(slow, 2))
    params = smol_like.total_params
    expected = 0.5 * (2 * 4 * params / 0.5e9 + 4 * params / 0.4e9)
    assert fsdp2.communication_s == pytest.approx(expected, rel=0.01)
