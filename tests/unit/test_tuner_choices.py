"""LoRA+'s learning-rate groups, LISA's layer sampling, PiSSA's conversion to a plain LoRA and
the rules that refuse tuner combinations by name."""

import pytest
import torch

from conftest import make_tiny_llama
from swiftlm.config import TrainConfig, parse_config
from swiftlm.config.rules import failures
from swiftlm.errors import ConfigError
from swiftlm.tuners.config import TunerArguments
from swiftlm.tuners.hooks import TunerHooks
from swiftlm.tuners.lisa import LayerSampler, sampled_layers
from swiftlm.tuners.lora_plus import tuner_param_groups
from swiftlm.tuners.setup import apply_tuner


def _lora(**flags):
    torch.manual_seed(0)
    return apply_tuner(make_tiny_llama(64), TunerArguments(lora_dropout=0, **flags))


def test_lora_plus_puts_every_b_matrix_at_the_ratio_and_the_rest_at_one():
    model = _lora(lorap_lr_ratio=16.0)
    groups = {g.name: g for g in tuner_param_groups(model, 16.0)}
    assert {n: g.lr_scale for n, g in groups.items()} == {"default": 1.0, "lora_B": 16.0}
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(".lora_B." in names[id(p)] for p in groups["lora_B"].params)
    assert all(".lora_B." not in names[id(p)] for p in groups["default"].params)
    listed = [id(p) for g in groups.values() for p in g.params]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(listed) == sorted(trainable)  # each trainable parameter once, none frozen
    assert len(groups["lora_B"].params) == 2 * 7  # 2 layers x 7 projections


def test_without_lora_plus_one_group_holds_every_trainable_parameter():
    model = _lora()
    (group,) = tuner_param_groups(model, None)
    assert group.lr_scale == 1.0
    assert len(group.params) == sum(p.requires_grad for p in model.parameters())


def test_the_b_matrices_get_their_own_groups_and_inner_optimizers_are_refused():
    from swiftlm.tuners.hooks import learning_rate_ratios

    args = TunerArguments(lorap_lr_ratio=4.0)
    model = _lora(lorap_lr_ratio=4.0)
    hooks = TunerHooks(model, args, seed=0, log=lambda _: None)
    lr, trained = 1e-4, [p for p in model.parameters() if p.requires_grad]
    decay = [{"params": trained, "weight_decay": 0.1}]
    plain = torch.optim.AdamW(decay, lr=lr)
    hooks.optimizer_built(plain)  # split in place
    assert learning_rate_ratios(model, plain) == {4.0}
    assert sorted(g["lr"] for g in plain.param_groups) == [lr, 4 * lr]
    assert all(g["weight_decay"] == 0.1 for g in plain.param_groups)  # settings kept
    assert sorted(id(p) for g in plain.param_groups for p in g["params"]) == sorted(
        map(id, trained)
    )
    hooks.optimizer_built(plain)  # already grouped: left as it is, not 16x
    assert sorted(g["lr"] for g in plain.param_groups) == [lr, 4 * lr]

    class Inner(torch.optim.AdamW):
        owns_inner_groups = True  # Muon's pair of optimizers

    with pytest.raises(ConfigError, match=r"--lorap_lr_ratio 4.0: .* at \[1.0\] x"):
        hooks.optimizer_built(Inner(trained, lr=lr))


def test_lisa_samples_are_seeded_per_window_and_freeze_only_decoder_layers():
    assert sampled_layers(8, 3, seed=1, window=5) == sampled_layers(8, 3, seed=1, window=5)
    windows = {tuple(sampled_layers(8, 3, seed=1, window=w)) for w in range(10)}
    assert len(windows) > 1 and all(len(set(w)) == 3 for w in windows)
    model = make_tiny_llama(64)  # 2 decoder layers
    sampler = LayerSampler(model, activated=1, interval=3, seed=1)
    sampler.apply(0, force=True)
    first = sampler.active
    sampler.apply(2)  # inside the window: unchanged
    assert sampler.active == first
    sampler.apply(3)
    assert sampler.active == sampled_layers(2, 1, seed=1, window=1)
    for name, param in model.named_parameters():
        if name.startswith("model.layers."):
            assert param.requires_grad == (int(name.split(".")[2]) in sampler.active), name
        else:  # embeddings, final norm, head
            assert param.requires_grad, name
    with pytest.raises(ConfigError, match="--lisa_activated_layers 3: the model has 2"):
        LayerSampler(model, activated=3, interval=3, seed=1)


def test_pissa_adapter_converted_to_lora_equals_the_trained_model_on_the_original_base(
    tmp_path,
):
    from peft import PeftModel

    torch.manual_seed(0)
    base = make_tiny_llama(64)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    args = TunerArguments(init_weights="pissa", lora_dropout=0)
    model = apply_tuner(base, args)
    hooks = TunerHooks(model, args, seed=0, log=lambda _: None)
    with torch.no_grad():  # "training": move every A and B
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.05)
    ids = torch.tensor([[3, 8, 1, 30, 12, 7]])
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path / "final")
    hooks.final_saved(tmp_path / "final")
    fresh = make_tiny_llama(64)
    fresh.load_state_dict(original)
    converted = PeftModel.from_pretrained(fresh, tmp_path / "final").eval()
    with torch.no_grad():
        got = converted(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert converted.peft_config["default"].r == 16


def _train(*flags):
    return parse_config(TrainConfig, ["--dataset", "d.jsonl", *map(str, flags)], "swiftlm sft")


@pytest.mark.parametrize(
    ("flags", "rule", "says"),
    [
        (["--train_type", "adalora"], "adalora_needs_its_allocator", "update_and_allocate"),
        (["--train_type", "vera", "--fsdp", "full_shard"], "peft_tuner_engines", "FSDP2"),
        (["--train_type", "oft", "--deepspeed", "zero2"], "peft_tuner_engines", "--deepspeed"),
        (
            ["--train_type", "loha", "--tensor_parallel_size", "2", "--nproc_per_node", "2"],
            "peft_tuner_engines",
            "--tensor_parallel_size",
        ),
        (["--train_type", "ia3", "--quant_method", "bnb"], "peft_tuner_quantized", "QLoRA"),
        (["--train_type", "vera", "--lorap_lr_ratio", "16"], "lorap_needs_lora", "B matrices"),
        (["--train_type", "lokr", "--init_weights", "pissa"], "init_weights_of_lora", "true or"),
        (["--init_weights", "loftq"], "loftq_needs_cuda", "CUDA"),
        (["--train_type", "dora", "--init_weights", "olora"], "pissa_not_with_dora", "DoRA"),
        (["--init_weights", "pissa", "--fsdp", "full_shard"], "pissa_engines", "FSDP2"),
        (["--lisa_activated_layers", "2"], "lisa_needs_full", "--train_type full"),
        (
            ["--train_type", "full", "--lisa_activated_layers", "2", "--nproc_per_node", "2"],
            "lisa_one_process",
            "2 processes",
        ),
    ],
)
def test_tuner_rules_refuse_by_name(flags, rule, says):
    broken = dict(failures(_train(*flags)))
    assert rule in broken, broken
    assert says in broken[rule]


@pytest.mark.parametrize(
    "flags",
    [
        ["--train_type", "vera", "--nproc_per_node", "2"],
        ["--lorap_lr_ratio", "16", "--init_weights", "pissa_niter_4"],
        ["--train_type", "full", "--lisa_activated_layers", "1"],
        ["--train_type", "boft", "--init_weights", "false"],
    ],
)
def test_tuner_combinations_that_train(flags):
    assert not [name for name, _ in failures(_train(*flags)) if name in _tuner_rule_names()]


def _tuner_rule_names() -> set[str]:
    from swiftlm.config.rules_tuners import TUNER_RULES

    return {rule.name for rule in TUNER_RULES}


def test_a_bad_init_weights_value_names_the_choices():
    with pytest.raises(ConfigError, match="--init_weights pisa must be one of true, false"):
        TunerArguments(init_weights="pisa")
    with pytest.raises(ConfigError, match="pissa_niter_N"):
        TunerArguments(init_weights="pissa_niter_0")
