"""--init_weights: how LoRA's A and B start (peft's `init_lora_weights`), and what PiSSA and
OLoRA change about saving.

PiSSA and OLoRA start the adapter from the principal part of each weight (SVD, QR) and take it
out of the base: W = W_res + s B0 A0. Training moves A and B only, so the trained model is
W_res + s B A, whose adapter means nothing on the original W. swiftlm therefore keeps two forms:

- checkpoints/step-N/ hold the adapter as trained (config `init_lora_weights: pissa`/`olora`):
  a resume rebuilds W_res by the same deterministic decomposition and loads A and B into it,
  and peft re-runs that decomposition when it loads such an adapter onto the original base;
- final/ holds it converted to a plain LoRA of the original base (peft's formula,
  `LoraModel.subtract_mutated_init`): W + dW = W_res + s B A with dW = s (B A - B0 A0) =
  s [B | -B0] [A ; A0], a LoRA of rank 2r at the same scale (alpha doubled, or x sqrt 2 with
  rsLoRA). Any LoRA loader (peft, vLLM, merge, GGUF export) reads it on the original model.
"""

import json
from pathlib import Path

import torch

from swiftlm.tuners.config import TunerArguments

# The initialisations that take a part of the base weights into the adapter.
MUTATING = ("pissa", "olora")


def peft_init_lora_weights(value: str) -> bool | str:
    """--init_weights as peft's `init_lora_weights` (true/false as booleans)."""
    return {"true": True, "false": False}.get(value, value)


def mutates_base(args: TunerArguments) -> bool:
    """Whether the run's initialisation takes part of the base weights into the adapter."""
    return args.init_weights.startswith(MUTATING)


def initial_adapter(model) -> dict[str, torch.Tensor]:
    """The adapter's weights as initialised (A0, B0), copied to the CPU: called right after
    peft built it, before any step or resume."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def convert_to_plain_lora(folder: Path, initial: dict[str, torch.Tensor]) -> None:
    """Rewrite the PiSSA/OLoRA adapter saved in `folder` as the plain LoRA of the original base
    that it equals (rank 2r, see the module docstring)."""
    from safetensors.torch import load_file, save_file

    weights_file = folder / "adapter_model.safetensors"
    trained = load_file(weights_file)
    converted = {}
    for name, tensor in trained.items():
        if "lora_A" in name:
            converted[name] = torch.cat([tensor, initial[name].to(tensor)], dim=0)
        elif "lora_B" in name:
            converted[name] = torch.cat([tensor, -initial[name].to(tensor)], dim=1)
        else:  # fully trained modules (modules_to_save) are the same in both forms
            converted[name] = tensor
    save_file(converted, str(weights_file), metadata={"format": "pt"})
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["r"] *= 2
    config["lora_alpha"] *= 2**0.5 if config.get("use_rslora") else 2
    config["init_lora_weights"] = True
    for pattern in ("rank_pattern", "alpha_pattern"):
        config[pattern] = {k: 2 * v for k, v in (config.get(pattern) or {}).items()}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
