"""`--optim` (train/optim.py, train/muon.py, train/low_rank.py): which parameters Muon gets, its
update against torch.optim.Muon and against the formula, state dicts that round-trip, the
default AdamW unchanged, and the refusals (config rules, bad --optim_args, DTensors)."""

import copy
import math

import pytest
import torch

from conftest import make_tiny_llama
from swiftlm.config import TrainConfig, parse_config
from swiftlm.config.rules import failures
from swiftlm.errors import ConfigError
from swiftlm.train.config import OPTIM_NAMES, TrainArguments, parse_optim_args
from swiftlm.train.muon import MuonWithAdamW, split_for_muon
from swiftlm.train.optim import build_optimizer, build_scheduler


def _args(**kw) -> TrainArguments:
    return TrainArguments(learning_rate=kw.pop("learning_rate", 1e-2), **kw)


def _named(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tie", [False, True])
def test_muon_gets_the_hidden_matrices_adamw_the_embeddings_head_and_vectors(tie):
    model = make_tiny_llama(64, tie=tie)
    hidden, rest = split_for_muon(model)
    hidden_names = _named(model, hidden)
    assert all(".layers." in n and n.endswith("proj.weight") for n in hidden_names)
    assert len(hidden_names) == 2 * 7  # q k v o gate up down, per layer
    rest_names = _named(model, rest)
    assert "model.embed_tokens.weight" in rest_names
    assert tie or "lm_head.weight" in rest_names
    assert all(p.ndim == 1 for n, p in model.named_parameters() if n in rest_names - {
        "model.embed_tokens.weight", "lm_head.weight"})  # fmt: skip


def _newton_schulz(matrix: torch.Tensor, steps=5, coefficients=(3.4445, -4.775, 2.0315)):
    """Muon's quintic Newton-Schulz iteration as Jordan et al. write it, in float64:
    X <- X / |X|_F (on the wide orientation); X <- aX + (bA + cA^2) X, A = X X^T."""
    a, b, c = coefficients
    x = matrix.double()
    wide = x.T if x.shape[0] > x.shape[1] else x
    wide = wide / wide.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = wide @ wide.T
        wide = a * wide + (b * gram + c * gram @ gram) @ wide
    return wide.T if x.shape[0] > x.shape[1] else wide


def test_muon_update_equals_torch_muon_and_the_formula():
    torch.manual_seed(0)
    weight = torch.randn(6, 4)
    grads = [torch.randn(6, 4) for _ in range(2)]
    lr, decay, momentum = 0.02, 0.1, 0.95

    ours = torch.nn.Parameter(weight.clone())
    composite = MuonWithAdamW(
        [{"params": [ours], "weight_decay": decay}], [],
        {"lr": lr, "adjust_lr_fn": "match_rms_adamw"}, {"lr": lr},
    )  # fmt: skip
    theirs = torch.nn.Parameter(weight.clone())
    reference = torch.optim.Muon(
        [theirs], lr=lr, weight_decay=decay, adjust_lr_fn="match_rms_adamw"
    )
    expected, buffer = weight.double(), torch.zeros(6, 4, dtype=torch.float64)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        composite.step()
        reference.step()
        buffer = momentum * buffer + (1 - momentum) * grad.double()
        nesterov = (1 - momentum) * grad.double() + momentum * buffer
        scale = 0.2 * math.sqrt(max(weight.shape))  # match_rms_adamw
        expected = expected * (1 - lr * decay) - lr * scale * _newton_schulz(nesterov)
    assert torch.equal(ours, theirs)  # the same arithmetic
    # torch iterates in bfloat16: each of the 5 steps rounds X (|entries| <= ~1) to bf16,
    # 2 steps of lr * scale (0.0098) move the weight by at most 2e-2; bound: 5 roundings of
    # bf16 epsilon per step on that move.
    bound = 2 * 5 * torch.finfo(torch.bfloat16).eps * lr * 0.2 * math.sqrt(6)
    assert (ours.double() - expected).abs().max().item() <= bound


def test_muon_composite_state_round_trips_and_the_scheduler_drives_both_halves():
    def build():
        model = make_tiny_llama(64, seed=1)
        return model, build_optimizer(model, _args(optim="muon"))

    def step(model, optimizer):
        ids = torch.arange(8).view(1, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = build()
    scheduler = build_scheduler(optimizer, _args(optim="muon", warmup_ratio=0.5), 4)
    step(model, optimizer)
    scheduler.step()
    rates = {g["lr"] for g in optimizer.param_groups}
    assert len(rates) == 1 and rates != {1e-2}  # one schedule for Muon's and AdamW's groups
    assert {type(o).__name__ for o in optimizer.inner} == {"Muon", "AdamW"}

    again, restored = build()
    again.load_state_dict(model.state_dict())
    # A checkpoint's copy: torch's load_state_dict keeps the given tensors (no clone).
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert restored.inner[0].param_groups[0] is restored.param_groups[0]
    step(model, optimizer)
    step(again, restored)
    for (name, a), b in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_adamw_torch_is_todays_optimizer():
    model = make_tiny_llama(64)
    optimizer = build_optimizer(model, _args())
    assert type(optimizer) is torch.optim.AdamW
    decay, no_decay = optimizer.param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.ndim < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8 and decay["foreach"]


def test_every_name_builds_an_optimizer_whose_state_is_tensors_and_numbers():
    """What the checkpoint files hold: tensors (safetensors) and JSON scalars, nothing else."""
    for name in OPTIM_NAMES:
        model = make_tiny_llama(64, seed=2)
        low_rank = name in ("galore_adamw", "apollo_adamw")
        args = _args(optim=name, optim_args="rank=4" if low_rank else None)
        optimizer = build_optimizer(model, args, num_steps=4)
        if hasattr(optimizer, "train"):
            optimizer.train()
        ids = torch.arange(8).view(1, 8)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        for entry in optimizer.state_dict()["state"].values():
            for key, value in entry.items():
                assert torch.is_tensor(value) or isinstance(value, (int, float)), (name, key)


def test_schedule_free_gets_a_constant_schedule_and_its_own_warmup():
    model = make_tiny_llama(64)
    args = _args(optim="schedule_free_adamw", warmup_ratio=0.25, lr_scheduler_type="cosine")
    optimizer = build_optimizer(model, args, num_steps=8)
    assert optimizer.param_groups[0]["warmup_steps"] == 2
    scheduler = build_scheduler(optimizer, args, 8)
    for _ in range(5):
        optimizer.train()
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize(
    ("optim", "text", "message"),
    [
        ("muon", "rank=3", "`rank` is not a setting of it; it takes momentum, nesterov"),
        ("galore_adamw", "rank", "`rank` is not key=value"),
        ("galore_adamw", "rank=big", "rank=big must be a int (default 128)"),
        ("muon", "nesterov=maybe", "nesterov=maybe must be a bool"),
        ("adafactor", "scale=1", "it takes none"),
    ],
)
def test_bad_optim_args_name_the_key_and_the_accepted_ones(optim, text, message):
    with pytest.raises(ConfigError, match="--optim_args for --optim " + optim) as error:
        parse_optim_args(optim, text)
    assert message in str(error.value)


def test_optim_args_are_typed_over_the_defaults():
    settings = parse_optim_args("galore_adamw", "rank=16, update_proj_gap=50,proj_type=left")
    assert settings == {"rank": 16, "update_proj_gap": 50, "scale": 0.25, "proj_type": "left"}


def _train(*flags) -> TrainConfig:
    return parse_config(TrainConfig, ["--dataset", "d.jsonl", *map(str, flags)], "swiftlm sft")


@pytest.mark.bad_input(
    input="an --optim the engine cannot drive (FSDP2/tensor parallel, DeepSpeed, LoRA)",
    outcome="A ConfigError before anything loads, naming --optim, why, and what to use instead",
)
@pytest.mark.parametrize(
    ("flags", "rule", "message"),
    [
        (["--fsdp", "fsdp2", "--optim", "adafactor"], "optim_takes_dtensors", "DTensor"),
        (["--tensor_parallel_size", 2, "--optim", "adamw_8bit"], "optim_takes_dtensors", "DDP"),
        (["--deepspeed", "zero2", "--optim", "muon"], "optim_under_deepspeed", "1-D partitions"),
        (["--optim", "galore_adamw"], "low_rank_projection_needs_full", "--train_type full"),
        (["--optim_target_modules", ".*attn.*"], "optim_target_modules_need_projection", "drop"),
    ],
)
def test_optimizers_an_engine_cannot_drive_are_refused_by_name(flags, rule, message):
    (name, text), *_ = failures(_train(*flags))
    assert name == rule and message in text and "--optim" in text


def test_fsdp2_takes_the_dtensor_capable_optimizers():
    for optim in ("adamw_torch", "muon", "schedule_free_adamw"):
        assert failures(_train("--fsdp", "fsdp2", "--optim", optim)) == []
    assert failures(_train("--optim", "galore_adamw", "--train_type", "full")) == []


def test_dtensor_parameters_are_refused_before_the_first_step(monkeypatch):
    """The backstop behind the rules: a strategy that shards reaches build_optimizer."""
    import torch.distributed.tensor as dtensor

    class FakeDTensor(torch.nn.Parameter):
        pass

    monkeypatch.setattr(dtensor, "DTensor", FakeDTensor)
    model = torch.nn.Linear(4, 4)
    model.weight = FakeDTensor(torch.zeros(4, 4))
    with pytest.raises(ConfigError, match="--optim adafactor updates plain tensors only"):
        build_optimizer(model, _args(optim="adafactor"))
    build_optimizer(model, _args(optim="adamw_torch"))
