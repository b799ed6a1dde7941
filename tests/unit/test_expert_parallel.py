"""Expert parallel (distributed/expert_parallel.py) on 2 gloo ranks equals the unsharded MoE
layer, forward and backward, on a tiny Qwen3-MoE and Mixtral layer; its gathered checkpoint
view, gradient reduction and global norm are those of the unsharded experts."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import make_tiny_moe
from swiftlm.distributed.expert_parallel import (
    ExpertShards,
    apply_expert_parallel,
    check_expert_parallel,
    stacked_parameters,
)
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.errors import ConfigError
from swiftlm.models.moe import expert_modules

SIZE, TOKENS = 2, 12
# fp32 against fp32: each value sums at most 128 products (the expert width x 2 + hidden) of
# O(1) terms per layer and the two paths order some sums differently (per-rank vs whole batch,
# a gradient of two ranks' tokens summed in another order): a few eps x sqrt(terms) ~ 1e-6.
TOLERANCE = 1e-5


def _layer(model_type: str, impl: str):
    model = make_tiny_moe(model_type, 64)
    model.set_experts_implementation(impl)
    return model.model.layers[0].mlp  # the sparse MoE block: router + stacked experts


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _compare_layer(model_type: str, impl: str, ep_mesh, rank: int) -> dict:
    """The block on all ranks' tokens unsharded vs expert parallel on this rank's tokens."""
    full = _layer(model_type, impl)
    split = copy.deepcopy(full)
    apply_expert_parallel(split, ep_mesh)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(SIZE, TOKENS, 64, generator=generator)
    upstream = torch.randn(SIZE, TOKENS, 64, generator=generator)
    everything = inputs.clone().requires_grad_()
    (full(everything) * upstream).sum().backward()
    mine = inputs[rank : rank + 1].clone().requires_grad_()
    out = split(mine)
    (out * upstream[rank : rank + 1]).sum().backward()
    errors = {
        "output": _max_error(out, full(inputs)[rank : rank + 1].detach()),
        "input grad": _max_error(mine.grad, everything.grad[rank : rank + 1]),
    }
    router = next(p for n, p in split.named_parameters() if "experts" not in n)
    reference = next(p for n, p in full.named_parameters() if "experts" not in n)
    router_grad = router.grad.clone()
    dist.all_reduce(router_grad)  # each rank's router saw its own tokens
    errors["router grad"] = _max_error(router_grad, reference.grad)
    local = expert_modules(split)[0].num_experts
    for got, want in zip(
        stacked_parameters(expert_modules(split)[0]),
        stacked_parameters(expert_modules(full)[0]),
        strict=True,
    ):
        shard = slice(rank * local, (rank + 1) * local)
        errors[f"expert grad {tuple(want.shape)}"] = _max_error(got.grad, want.grad[shard])
    return errors


def _compare_one_sided_routing(ep_mesh, rank: int) -> float:
    """Every token routed to rank 0's experts: rank 1 receives no rows and still takes part."""
    full = expert_modules(_layer("qwen3_moe", "grouped_mm"))[0]
    split = copy.deepcopy(full)
    apply_expert_parallel(split, ep_mesh)
    generator = torch.Generator().manual_seed(2 + rank)
    hidden = torch.randn(TOKENS, 64, generator=generator)
    index = torch.randint(0, 4, (TOKENS, 2), generator=generator)
    weights = torch.rand(TOKENS, 2, generator=generator)
    out = split(hidden, index, weights)
    out.sum().backward()
    return _max_error(out, full(hidden, index, weights).detach())


def _checkpoint_view(rank: int) -> dict:
    """gathered() shows the full experts (and moments) and leaves each rank its slice; the
    reduction and the global norm match the unsharded gradients."""
    mesh = ParallelDims(dp=SIZE, ep=SIZE).build_mesh("cpu")
    full = _layer("mixtral", "grouped_mm")
    split = copy.deepcopy(full)
    apply_expert_parallel(split, mesh["ep"])
    shards = ExpertShards.of(split, mesh, dp_size=SIZE)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (split, full)]
    for model, optimizer in zip((split, full), optimizers, strict=True):
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        optimizer.step()  # elementwise: each shard steps as its slice of the full stack does
    optimizer, reference = optimizers
    wanted = stacked_parameters(expert_modules(full)[0])
    local = [p.detach().clone() for p in shards.parameters]
    figures = {}
    with shards.gathered(optimizer):
        figures["full weights"] = all(
            torch.equal(p, w) for p, w in zip(shards.parameters, wanted, strict=True)
        )
        figures["full moments"] = all(
            torch.equal(optimizer.state[p]["exp_avg_sq"], reference.state[w]["exp_avg_sq"])
            for p, w in zip(shards.parameters, wanted, strict=True)
        )
    figures["slices kept"] = all(
        torch.equal(p, q) for p, q in zip(shards.parameters, local, strict=True)
    )
    figures["moments sliced"] = all(
        optimizer.state[p]["exp_avg"].shape == p.shape for p in shards.parameters
    )
    # Shard gradients as the all-to-all leaves them (both ranks' tokens already in), scaled by
    # dp as the loop scales: reduced, rank r's shard holds 2 (r + 1). DDP averaged the rest.
    dense = [p for p in split.parameters() if all(p is not q for q in shards.parameters)]
    for param in dense:
        param.grad = torch.full_like(param, 1.5)
    for param in shards.parameters:
        param.grad = torch.full_like(param, 2.0 * (rank + 1) * SIZE)
    shards.reduce_gradients()
    figures["reduced"] = all(
        torch.equal(p.grad, torch.full_like(p, 2.0 * (rank + 1))) for p in shards.parameters
    )
    shard_elements = sum(p.numel() for p in shards.parameters)
    expected = sum(p.numel() for p in dense) * 1.5**2 + shard_elements * (2.0**2 + 4.0**2)
    figures["norm"] = abs(shards.clip_grad_norm(list(split.parameters()), 1e9) - expected**0.5)
    figures["expected norm"] = expected**0.5
    return figures


def _worker(rank, folder, results):
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=SIZE
    )
    from torch.distributed.device_mesh import init_device_mesh

    ep_mesh = init_device_mesh("cpu", (SIZE,), mesh_dim_names=("ep",))
    found = {}
    for model_type, impl in [
        ("qwen3_moe", "grouped_mm"),
        ("mixtral", "grouped_mm"),
        ("qwen3_moe", "eager"),
    ]:
        found[f"{model_type} {impl}"] = _compare_layer(model_type, impl, ep_mesh, rank)
    found["one-sided routing"] = _compare_one_sided_routing(ep_mesh, rank)
    found["checkpoint view"] = _checkpoint_view(rank)
    results[rank] = found
    dist.destroy_process_group()


def test_expert_parallel_layer_equals_the_unsharded_experts(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(tmp_path, results), nprocs=SIZE)
    for rank in range(SIZE):
        found = results[rank]
        for case in ("qwen3_moe grouped_mm", "mixtral grouped_mm", "qwen3_moe eager"):
            for what, error in found[case].items():
                assert error < TOLERANCE, (rank, case, what, error)
        assert found["one-sided routing"] < TOLERANCE, rank
        view = found["checkpoint view"]
        assert view["full weights"] and view["full moments"], (rank, view)
        assert view["slices kept"] and view["moments sliced"], (rank, view)
        assert view["reduced"], (rank, view)
        assert view["norm"] < 1e-6 * view["expected norm"], (rank, view)


@pytest.mark.bad_input(
    input="`--expert_parallel_size N` on a dense model, or with experts per layer that N does "
    "not divide",
    outcome="Usage error when the experts are split: names the model, its expert count and a "
    "size that divides it (or to drop the flag)",
)
def test_expert_parallel_refuses_what_it_cannot_split(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model; .* has no experts"):
        check_expert_parallel(dense, 2)
    moe = make_tiny_moe("qwen3_moe", 64)
    with pytest.raises(ConfigError, match="has 8 experts per layer, which do not split into 3"):
        check_expert_parallel(moe, 3)
    check_expert_parallel(moe, 4)  # 8 experts split 4 ways


@pytest.mark.bad_input(
    input="`--expert_parallel_size` with LoRA on the stacked experts (`--target_modules "
    "all-linear` on an MoE model)",
    outcome="Usage error: the adapters span every expert; names --train_type full or "
    "attention-only --target_modules",
)
def test_lora_on_experts_is_refused_under_expert_parallel():
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(
        make_tiny_moe("mixtral", 64),
        LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["experts.down_proj"]),
    )
    with pytest.raises(ConfigError, match="LoRA on the stacked experts .* --train_type full"):
        check_expert_parallel(adapted, 2)
    attention_only = LoraConfig(r=2, target_modules=["q_proj"])
    check_expert_parallel(get_peft_model(make_tiny_moe("mixtral", 64), attention_only), 2)


def _train_config(*flags):
    from swiftlm.config import TrainConfig, parse_config

    argv = ["--dataset", "d.jsonl", "--expert_parallel_size", "2", *map(str, flags)]
    return parse_config(TrainConfig, argv, "swiftlm sft")


@pytest.mark.bad_input(
    input="`--expert_parallel_size N` that does not divide the processes, or with tensor, "
    "pipeline, sequence or DeepSpeed parallelism, --fsdp_offload, --torch_compile, "
    "--eval_dataset or "
    "`swiftlm rlhf`",
    outcome="Usage error before anything loads, naming the flags, the reason and the fix",
)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "must divide the data-parallel processes (1)"),
        (["--nproc_per_node", 3], "must divide the data-parallel processes (3)"),
        (["--nproc_per_node", 4, "--tensor_parallel_size", 2], "expert shards run beside DDP"),
        (["--nproc_per_node", 4, "--pipeline_parallel_size", 2], "expert shards run beside DDP"),
        (["--nproc_per_node", 4, "--sequence_parallel_size", 2], "expert shards run beside DDP"),
        (["--nproc_per_node", 2, "--deepspeed", "zero2"], "expert shards run beside DDP"),
        (["--nproc_per_node", 2, "--fsdp", "fsdp2", "--fsdp_offload", "true"], "drop --fsdp_of"),
        (["--nproc_per_node", 2, "--torch_compile", "true"], "drop --torch_compile"),
        (["--nproc_per_node", 2, "--eval_dataset", "swiftlm/quick"], "generation runs on rank 0"),
    ],
)
def test_expert_parallel_flag_combinations_are_refused(flags, message):
    from swiftlm.config.rules import check

    with pytest.raises(ConfigError, match="--expert_parallel_size 2") as raised:
        check(_train_config(*flags))
    assert message in str(raised.value)


def test_expert_parallel_is_refused_for_rlhf():
    from swiftlm.config import RLHFConfig, parse_config
    from swiftlm.config.rules import failures

    argv = ["--dataset", "d.jsonl", "--expert_parallel_size", "2", "--nproc_per_node", "2"]
    cfg = parse_config(RLHFConfig, argv, "swiftlm rlhf")
    assert "expert_parallel_for_sft_and_pt" in [name for name, _ in failures(cfg)]


def test_two_ranks_with_expert_parallel_2_break_no_rule():
    from swiftlm.config.rules import failures

    assert failures(_train_config("--nproc_per_node", 2)) == []
    assert failures(_train_config("--nproc_per_node", 4)) == []
    assert failures(_train_config("--nproc_per_node", 2, "--fsdp", "fsdp2")) == []


def _replicas_worker(rank, folder, results):
    """4 ranks, expert groups of 2: each slice of experts has 2 replicas, in other groups."""
    world = 4
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world
    )
    mesh = ParallelDims(dp=world, ep=SIZE).build_mesh("cpu")
    full = _layer("qwen3_moe", "grouped_mm")
    split = copy.deepcopy(full)
    apply_expert_parallel(split, mesh["ep"])
    shards = ExpertShards.of(split, mesh, dp_size=world)
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(world, TOKENS, 64, generator=generator)
    (full(inputs) ** 2).sum().backward()
    # Each rank's loss multiplied by the data-parallel ranks, as the loop does for DDP.
    (split(inputs[rank : rank + 1]) ** 2).sum().mul(world).backward()
    shards.reduce_gradients()
    local = expert_modules(split)[0].num_experts
    mine = slice(mesh["ep"].get_local_rank() * local, (mesh["ep"].get_local_rank() + 1) * local)
    wanted = stacked_parameters(expert_modules(full)[0])
    results[rank] = max(
        _max_error(got.grad, want.grad[mine])
        for got, want in zip(shards.parameters, wanted, strict=True)
    )
    dist.destroy_process_group()


def test_four_ranks_reduce_expert_gradients_over_their_replicas(tmp_path):
    """2 expert groups of 2: a slice's gradient, summed over its 2 replicas and divided by the
    4 data-parallel ranks, is the unsharded experts' gradient over all 4 ranks' tokens."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_replicas_worker, args=(tmp_path, results), nprocs=4)
    for rank in range(4):
        assert results[rank] < TOLERANCE, (rank, results[rank])
