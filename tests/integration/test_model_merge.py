"""`swiftlm export --merge_models`: fine-tunes of the tiny Llama (two full models, one LoRA
adapter) merged by each method; every weight of the saved folder equals the method's formula
written out here, tensor by tensor; bad inputs are refused by name."""

import math

import pytest
import torch

from swiftlm.cli.main import main

DENSITY = 0.4


def _fine_tune(base_dir, out, seed: int):
    """The base with seeded noise on every weight: a stand-in for a full fine-tune."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


def _adapter(base_dir, out):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("merge-inputs")
    return {
        "a": _fine_tune(tiny_model_dir, folder / "a", 1),
        "b": _fine_tune(tiny_model_dir, folder / "b", 2),
        "lora": _adapter(tiny_model_dir, folder / "lora"),
    }


def _params(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {name: p.detach() for name, p in model.named_parameters()}


def _merged_adapter(base_dir, adapter) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return {name: p.detach() for name, p in merged.named_parameters()}


def _trimmed(task: torch.Tensor) -> torch.Tensor:
    """TIES' trim: the largest DENSITY share of the values by magnitude, the rest 0."""
    keep = int(DENSITY * task.numel())
    flat = task.reshape(-1)
    mask = torch.zeros_like(flat)
    mask[flat.abs().argsort(descending=True)[:keep]] = 1
    return (flat * mask).reshape(task.shape)


def _ties(base, models, weights):
    tasks = [_trimmed(m - base) for m in models]
    sign = torch.where(sum(tasks) >= 0, 1.0, -1.0)
    agree = [torch.sign(t) == sign for t in tasks]  # a trimmed 0 agrees with no sign
    total = sum(w * t * a for w, t, a in zip(weights, tasks, agree, strict=True))
    return base + total / torch.clamp(sum(a.float() for a in agree), min=1.0)


def _slerp(t, a, b):
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    cosine = float(torch.dot(x / x.norm(), y / y.norm()))
    if abs(cosine) > 0.9995:
        return (1 - t) * a + t * b
    angle = math.acos(cosine)
    mixed = (math.sin((1 - t) * angle) * x + math.sin(t * angle) * y) / math.sin(angle)
    return mixed.reshape(a.shape).float()


def _expected(method, base, models, weights, t=0.5):
    if method == "linear":
        return sum(w * m for w, m in zip(weights, models, strict=True)) / sum(weights)
    if method == "task_arithmetic":
        return base + sum(w * (m - base) for w, m in zip(weights, models, strict=True))
    if method == "ties":
        return _ties(base, models, weights)
    return _slerp(t, *models)


def _export(tiny_model_dir, out, models, method, *extra):
    argv = ["export", "--model", str(tiny_model_dir), "--output_dir", str(out)]
    argv += ["--merge_models", *map(str, models), "--merge_method", method, *extra]
    return main(argv)


@pytest.mark.numerics
@pytest.mark.parametrize(
    "method, weights",
    [
        ("linear", [0.7, 0.3]),
        ("task_arithmetic", [0.6, 0.8]),
        ("ties", [1.0, 0.5]),
        ("slerp", None),
    ],
)
def test_each_weight_is_the_formula_of_its_method(
    method, weights, inputs, tiny_model_dir, tmp_path, capsys
):
    """Float32 elementwise sums of <= 3 terms of magnitude ~0.1: rounding ~1e-8; 1e-6 bounds it
    (slerp's reference runs in float64)."""
    models = [inputs["a"], inputs["lora"]]
    extra = ["--merge_density", str(DENSITY)]
    if weights:
        extra += ["--merge_weights", *map(str, weights)]
    assert _export(tiny_model_dir, tmp_path / "out", models, method, *extra) == 0
    assert f"merged 2 models by {method}" in capsys.readouterr().out
    base = _params(tiny_model_dir)
    tuned = [_params(inputs["a"]), _merged_adapter(tiny_model_dir, inputs["lora"])]
    got = _params(tmp_path / "out")
    for name, tensor in base.items():
        expected = _expected(method, tensor, [m[name] for m in tuned], weights or [0.5, 0.5])
        assert torch.allclose(got[name], expected, atol=1e-6, rtol=0), (method, name)
    assert (tmp_path / "out" / "merge_config.json").is_file()


@pytest.mark.numerics
def test_dare_drops_values_at_the_density_and_rescales_them(inputs, tiny_model_dir, tmp_path):
    """dare_linear: base + Σ w (mask τ) / density, each mask Bernoulli(density); the same seed
    gives the same merge, another seed another one."""
    models = [inputs["a"], inputs["b"]]
    flags = ["--merge_density", "0.5", "--merge_weights", "1.0", "1.0"]
    for name, seed in (("one", "0"), ("same", "0"), ("other", "1")):
        out = tmp_path / name
        assert (
            _export(tiny_model_dir, out, models, "dare_linear", *flags, "--merge_seed", seed) == 0
        )
    one, same, other = (_params(tmp_path / name) for name in ("one", "same", "other"))
    assert all(torch.equal(one[n], same[n]) for n in one)
    assert not all(torch.equal(one[n], other[n]) for n in one)
    base = _params(tiny_model_dir)
    a, b = _params(inputs["a"]), _params(inputs["b"])
    name = "model.layers.0.mlp.down_proj.weight"
    tasks = (a[name] - base[name], b[name] - base[name])
    merged = one[name] - base[name]
    # Each element is 0, 2 τ_a, 2 τ_b or 2 (τ_a + τ_b): which of the four, the masks say.
    candidates = torch.stack([0 * tasks[0], 2 * tasks[0], 2 * tasks[1], 2 * sum(tasks)])
    closest = (candidates - merged).abs().min(dim=0).values
    assert float(closest.max()) < 1e-6
    kept_a = (candidates[1] - merged).abs().le(1e-6) | (candidates[3] - merged).abs().le(1e-6)
    assert 0.4 < float(kept_a.float().mean()) < 0.6  # ~density of τ_a survives


def test_bad_merges_are_refused_by_name(inputs, tiny_model_dir, tmp_path, capsys):
    three = [inputs["a"], inputs["b"], inputs["lora"]]
    assert _export(tiny_model_dir, tmp_path / "s", three, "slerp") == 2
    assert "slerp interpolates between two models" in capsys.readouterr().err
    two = [inputs["a"], inputs["b"]]
    assert _export(tiny_model_dir, tmp_path / "w", two, "ties", "--merge_weights", "1") == 2
    assert "--merge_weights has 1 values for 2 --merge_models" in capsys.readouterr().err
    assert _export(tiny_model_dir, tmp_path / "m", [tmp_path], "linear") != 0
    assert "not a model folder" in capsys.readouterr().err


def test_a_model_of_another_shape_is_not_a_fine_tune(inputs, tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from conftest import make_tiny_llama

    other = tmp_path / "wider"
    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    make_tiny_llama(vocab, hidden_size=32).save_pretrained(other)
    assert _export(tiny_model_dir, tmp_path / "out", [inputs["a"], other], "linear") != 0
    assert "not a fine-tune of --model" in capsys.readouterr().err
