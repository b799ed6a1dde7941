"""Several fine-tunes of one base merged into one model (`swiftlm export --merge_models A B
--merge_method ties`), saved as a plain Hugging Face folder.

Each input is a full model folder, a LoRA/DoRA adapter over --model (merged into a copy of
it first), or a swiftlm run directory (its final/ folder). Per weight tensor, with θ_b the
base's, θ_i model i's, τ_i = θ_i - θ_b its task vector and w_i its weight:

- linear: Σ w_i θ_i / Σ w_i;
- task_arithmetic: θ_b + Σ w_i τ_i;
- ties: each τ_i keeps its largest `density` share by magnitude; per element the sign of
  Σ τ_i wins, and θ_b + the mean of the agreeing w_i τ_i is taken (peft's `ties`: the
  weighted values are divided by how many agree, not by their weights' sum);
- dare_linear / dare_ties: each element of τ_i is kept with probability `density` and
  rescaled by 1 / density (seeded), then summed as task_arithmetic or merged as ties;
- slerp (two models): θ = sin((1-t)Ω)/sin Ω θ_0 + sin(tΩ)/sin Ω θ_1, Ω the angle between
  the two tensors, linear where they are nearly parallel (mergekit's rule).

The pruning, sign election and disjoint mean are peft's (`peft.utils.merge_utils`, the code
behind `add_weighted_adapter`); slerp is written here. Everything runs in float32 on the CPU
and holds every input in memory (n + 1 copies of the model in float32). Tied weights are
merged once. The folder read back must give the in-memory merged model's logits.
"""

import copy
import json
import math
import warnings
from pathlib import Path

import torch

from swiftlm.errors import ConfigError
from swiftlm.export.checks import (
    CHECK_PROMPTS,
    Tolerance,
    chat_inputs,
    compare_logits,
    forward_logits,
)
from swiftlm.models.loader import load_model, load_tokenizer, resolve_model

# The same float32 weights and operations: the folder read back must match to rounding.
TOLERANCE = Tolerance(atol=1e-5, rtol=1e-6)
# Cosine above which slerp interpolates linearly (the angle is too small to divide by).
PARALLEL = 0.9995
CPU = torch.device("cpu")


def _weights(cfg) -> list[float]:
    e = cfg.export
    return e.merge_weights or [1.0 / len(e.merge_models)] * len(e.merge_models)


def _input_folder(path: str) -> Path:
    """A fine-tune's folder: the path itself, or a run directory's final/ folder."""
    folder = Path(path)
    final = folder / "final"
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        folder = final
    if not folder.is_dir():
        raise ConfigError(
            f"--merge_models {path}: not a model folder (config.json), an adapter folder "
            "(adapter_config.json) or a run directory with a final/ folder"
        )
    return folder


def _load_input(path: str, base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A fine-tune's parameters by name, float32: an adapter merged into a copy of `base`."""
    folder = _input_folder(path)
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(copy.deepcopy(base), str(folder))
        except (RuntimeError, ValueError, KeyError) as error:  # peft's size/name mismatches
            raise ConfigError(
                f"--merge_models {path}: the adapter does not fit --model ({error}); merge "
                "adapters trained on that base model only"
            ) from error
        model = model.merge_and_unload()
    else:
        model = load_model(str(folder), torch.float32, CPU)
    return dict(model.named_parameters())


def _check_same_shapes(path: str, params: dict, base: dict) -> None:
    for name, tensor in base.items():
        if name not in params or params[name].shape != tensor.shape:
            found = tuple(params[name].shape) if name in params else "no such tensor"
            raise ConfigError(
                f"--merge_models {path}: not a fine-tune of --model: its {name} is {found}, the "
                f"base's {tuple(tensor.shape)}; merge models of one base model only"
            )


def slerp(t: float, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Spherical interpolation between two tensors (mergekit's: the angle of their
    directions, applied to the tensors themselves); linear when they are nearly parallel."""
    a, b = first.reshape(-1), second.reshape(-1)
    cosine = torch.dot(a / a.norm().clamp(min=1e-12), b / b.norm().clamp(min=1e-12))
    cosine = float(cosine.clamp(-1.0, 1.0))
    if abs(cosine) > PARALLEL:
        return (1 - t) * first + t * second
    angle = math.acos(cosine)
    return (math.sin((1 - t) * angle) * first + math.sin(t * angle) * second) / math.sin(angle)


def merge_tensor(method: str, base, tensors, weights, density: float, t: float):
    """The merged value of one weight tensor (`tensors`: the inputs', in order)."""
    from peft.utils import merge_utils

    if method == "slerp":
        return slerp(t, tensors[0], tensors[1])
    w = torch.tensor(weights, dtype=torch.float32)
    if method == "linear":
        return sum(wi * x for wi, x in zip(weights, tensors, strict=True)) / float(w.sum())
    tasks = [x - base for x in tensors]
    if method == "task_arithmetic":
        return base + merge_utils.task_arithmetic(tasks, w)
    with warnings.catch_warnings():  # density 1 keeps every value: peft warns, as it should
        warnings.simplefilter("ignore")
        return base + getattr(merge_utils, method)(tasks, w, density)


def merged_parameters(cfg, base: torch.nn.Module, inputs: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter of `base` merged from the inputs' (tied ones once: named_parameters
    lists a shared tensor under its first name only)."""
    e = cfg.export
    torch.manual_seed(e.merge_seed)  # dare's drops, in the fixed order of the parameters
    weights = _weights(cfg)
    merged = {}
    for name, tensor in base.named_parameters():
        values = [params[name].detach() for params in inputs]
        merged[name] = merge_tensor(
            e.merge_method, tensor.detach(), values, weights, e.merge_density, e.merge_t
        )
    return merged


def _describe(cfg) -> dict:
    e = cfg.export
    return {
        "base": cfg.model.model,
        "models": list(e.merge_models),
        "method": e.merge_method,
        "weights": _weights(cfg),
        "density": e.merge_density,
        "t": e.merge_t,
        "seed": e.merge_seed,
    }


def merge_models(cfg, out: Path) -> dict:
    """Merge --merge_models over --model by --merge_method, save to `out`, check the folder
    read back against the merged model; raise ExportCheckError if they differ."""
    base_path = resolve_model(cfg.model.model).path
    print(f"Loading the base model {cfg.model.model}", flush=True)
    base = load_model(base_path, torch.float32, CPU)
    named = dict(base.named_parameters())
    inputs = []
    for path in cfg.export.merge_models:
        print(f"Loading {path}", flush=True)
        params = _load_input(path, base)
        _check_same_shapes(path, params, named)
        inputs.append(params)
    with torch.no_grad():
        for name, value in merged_parameters(cfg, base, inputs).items():
            named[name].copy_(value)
    del inputs
    tokenizer = load_tokenizer(base_path)
    check = chat_inputs(tokenizer, CHECK_PROMPTS[:3])
    expected = forward_logits(base, check)
    base.save_pretrained(out, max_shard_size=cfg.export.max_shard_size)
    tokenizer.save_pretrained(out)
    description = _describe(cfg)
    (out / "merge_config.json").write_text(json.dumps(description, indent=2) + "\n")
    reloaded = load_model(str(out), torch.float32, CPU)
    saved = compare_logits(
        forward_logits(reloaded, check), expected, check["attention_mask"], TOLERANCE
    )
    print(
        f"merged {len(cfg.export.merge_models)} models by {cfg.export.merge_method}; the saved "
        f"folder read back gives the merged model's logits to {saved.max_abs_diff:.2e} "
        f"(3 prompts, tolerance {TOLERANCE})"
    )
    saved.require(f"{out} read back", "the merged model", str(out))
    print(f"merged model saved to {out}")
    return {**description, "output": str(out), "saved_max_abs_diff": saved.max_abs_diff}
