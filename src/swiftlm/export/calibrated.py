"""`swiftlm export --quant_method gptq|awq`: weights quantized with calibration data, saved as
a Hugging Face folder in the standard GPTQ or AWQ (GEMM) format, checked before returning.

GPTQ (4 or 8 bits) and AWQ (4 bits) both look at real activations: conversations from
`--dataset`, loaded and chat-templated by the same code as training (`data/loading.py`,
`data/encode.py`), choose how each layer's weights are rounded. Without `--dataset` the
built-in SFT mix is used. The quantizer is GPT-QModel (`gptqmodel`), on CUDA when there is a
GPU and on the CPU otherwise (its torch kernels). transformers reads GPTQ folders back
through `optimum` + `gptqmodel` and AWQ folders through `gptqmodel`. Both are optional
(`swiftlm[gptq]`): `validate_calibrated` names the install command when one is missing,
before anything loads.

The export checks itself like the other quantized folders (`checks.check_folder_read_back`):
read back by transformers from the folder alone, it must give a non-empty greedy answer to
every check prompt, and its perplexity on the held-out text may exceed the float32 source's
by at most MAX_PPL_INCREASE (10% at 8 bits, 150% at 4).
"""

import importlib.util
import os
import random
import time
from pathlib import Path

from swiftlm.config import ExportConfig
from swiftlm.config.rules_export import CALIBRATED_BITS, GROUP_SIZES, MIN_CALIBRATION_TOKENS
from swiftlm.errors import ConfigError
from swiftlm.export.checks import (
    check_folder_read_back,
    folder_bytes,
    quantized_input_widths,
    source_perplexity,
)
from swiftlm.export.source import ExportSource
from swiftlm.models.loader import load_tokenizer, pick_device

# gptqmodel quantizes; optimum is what transformers' GPTQ loader calls into (AWQ needs only
# gptqmodel), and the self-check loads the folder through transformers.
REQUIRED_PACKAGES = {"gptq": ("gptqmodel", "optimum"), "awq": ("gptqmodel",)}
INSTALL_HINT = "pip install 'swiftlm[gptq]'"
# Used when no --dataset is given: the conversations `swiftlm sft` trains on by default.
BUILTIN_CALIBRATION_DATASETS = ["swiftlm/self-cognition", "swiftlm/general-qa"]
# What to try when the folder read back loses more perplexity than MAX_PPL_INCREASE allows.
PPL_FIX = "try more --quant_n_samples, a smaller --group_size, or --quant_bits 8"


def validate_calibrated(cfg: ExportConfig) -> None:
    """Fail fast, before any model loads, when a package --quant_method gptq|awq needs is
    missing. The flags themselves have passed `rules.check` (bits, AWQ's group sizes and
    --max_length) and their sections (--group_size, --quant_n_samples)."""
    method = cfg.quant.quant_method
    missing = [name for name in REQUIRED_PACKAGES[method] if not _installed(name)]
    if missing:
        raise ConfigError(
            f"--quant_method {method} needs {' and '.join(missing)}, which could not be found; "
            f"install them with `{INSTALL_HINT}`"
        )


def _installed(name: str) -> bool:
    # find_spec, not import: importing gptqmodel takes seconds and sets environment variables.
    return importlib.util.find_spec(name) is not None


def quant_bits(cfg: ExportConfig) -> int:
    """--quant_bits, defaulting to the method's first width in CALIBRATED_BITS (4)."""
    q = cfg.quant
    return q.quant_bits if q.quant_bits is not None else CALIBRATED_BITS[q.quant_method][0]


def export_calibrated(source: ExportSource, out: Path, cfg: ExportConfig) -> dict:
    """Quantize `source` with GPTQ or AWQ into `out`, check the folder read back, and return a
    report; raise ExportCheckError when the check fails."""
    started = time.perf_counter()
    q = cfg.quant
    method, bits = q.quant_method, quant_bits(cfg)
    device = _quantization_device(cfg)
    check_group_size(source.model_path, method, q.group_size)
    tokenizer = load_tokenizer(source.tokenizer_path)
    calibration, described = calibration_samples(cfg, tokenizer)
    print(
        f"Calibrating {method.upper()} {bits}-bit (group size {q.group_size}) on "
        f"{len(calibration)} samples from {described}",
        flush=True,
    )
    ppl_source = source_perplexity(source, tokenizer)
    _quantize_and_save(source.model_path, out, calibration, method, bits, q.group_size, device)
    # The source's tokenizer (with the chat template swiftlm trains with) replaces the one
    # gptqmodel copied from the model folder, which may lack it.
    tokenizer.save_pretrained(out)
    measured = check_folder_read_back(out, device, ppl_source, bits, PPL_FIX)
    report = {
        "output": str(out),
        "bytes": folder_bytes(out),
        "method": method,
        "bits": bits,
        "group_size": q.group_size,
        "n_samples": len(calibration),
        "calibration": described,
        "ppl_source": ppl_source,
        **measured,
        "seconds": time.perf_counter() - started,
    }
    print(
        f"{method.upper()} {bits}-bit model saved to {out} ({report['bytes'] / 2**20:.1f} MiB, "
        f"{report['seconds']:.0f} s)"
    )
    return report


def check_group_size(model_path: str, method: str, group_size: int) -> None:
    """Every quantized layer's input width must be a multiple of the group size: torch's int4
    CPU matmul, which transformers runs these folders with, refuses partial groups (found on
    SmolLM2's width 576 with the default 128, after minutes of quantizing), and GPU kernels
    are not expected to be kinder. Checked on the empty (meta) model, before weights load."""
    if group_size == -1:
        return
    widths = quantized_input_widths(model_path)
    if all(w % group_size == 0 for w in widths):
        return
    fitting = [g for g in GROUP_SIZES[::-1] if all(w % g == 0 for w in widths)]
    if fitting:
        fix = f"--group_size {fitting[0]}"
    elif method == "gptq":
        fix = "--group_size -1 (one scale per channel)"
    else:
        fix = "--quant_method gptq --group_size -1 (one scale per channel)"
    raise ConfigError(
        f"--group_size {group_size} does not divide the input widths of this model's layers "
        f"({', '.join(str(w) for w in sorted(widths))}); pass {fix}"
    )


def _quantization_device(cfg: ExportConfig) -> str:
    # gptqmodel runs on CUDA or the CPU; mps falls back to the CPU.
    return "cuda:0" if pick_device(cfg.model.device).type == "cuda" else "cpu"


def calibration_samples(cfg: ExportConfig, tokenizer) -> tuple[list[dict], str]:
    """Up to --quant_n_samples token sequences (at most --max_length tokens each) from
    --dataset, rendered with the chat template like training, and a description of them."""
    from functools import partial

    from swiftlm.data.encode import encode_chat_samples
    from swiftlm.data.formats import chat_sample
    from swiftlm.data.loading import load_samples

    d = cfg.data
    specs = d.dataset or BUILTIN_CALIBRATION_DATASETS
    placeholders = {"{{NAME}}": cfg.model.model_name, "{{AUTHOR}}": cfg.model.model_author}
    to_sample = partial(chat_sample, system=d.system, placeholders=placeholders, method="export")
    samples, report = load_samples(
        specs, to_sample, skip_bad_rows=d.skip_bad_rows, seed=d.data_seed
    )
    if report.skipped:
        print(report.summary())
    samples = _seeded_subset(samples, cfg.quant.quant_n_samples, d.data_seed)
    # Right truncation: an over-long conversation still calibrates with its first tokens;
    # "all" because calibration looks at every token, not only those training would learn.
    encoded, _ = encode_chat_samples(tokenizer, samples, d.max_length, "right", "all")
    calibration = [
        {"input_ids": item["input_ids"], "attention_mask": [1] * len(item["input_ids"])}
        for item in encoded
        if len(item["input_ids"]) >= MIN_CALIBRATION_TOKENS
    ]
    where = ", ".join(specs) + ("" if d.dataset else " (built-in; pass --dataset for your own)")
    if not calibration:
        raise ConfigError(f"no calibration sample of {MIN_CALIBRATION_TOKENS}+ tokens in {where}")
    return calibration, where


def _seeded_subset(samples: list, count: int, seed: int) -> list:
    """`count` distinct samples chosen by `seed` (all of them when there are fewer):
    repeating a conversation adds nothing to calibration."""
    if len(samples) <= count:
        return samples
    picked = sorted(random.Random(seed).sample(range(len(samples)), count))
    return [samples[i] for i in picked]


def _quantize_and_save(
    model_path: str,
    out: Path,
    calibration: list[dict],
    method: str,
    bits: int,
    group_size: int,
    device: str,
) -> None:
    _prepare_gptqmodel_environment()
    from gptqmodel import BACKEND, AWQConfig, GPTQConfig, GPTQModel

    _keep_logs_in(out / "quantization_logs")

    if method == "awq":
        config = AWQConfig(bits=bits, group_size=group_size, device=device)
        # Its AUTO choice packs with the CUDA GEMM kernel and refuses to start without a GPU;
        # the torch packer writes the same GEMM format on any device.
        backend = BACKEND.AWQ_TORCH
    else:
        config = GPTQConfig(bits=bits, group_size=group_size, device=device)
        backend = BACKEND.AUTO
    # The config's device is where layers are quantized; the full model stays on the CPU.
    model = GPTQModel.load(model_path, config)
    model.quantize(calibration, batch_size=1, backend=backend)
    model.save(str(out))
    del model


def _prepare_gptqmodel_environment() -> None:
    """Settings gptqmodel reads when it first builds its worker pools."""
    # On a 1-2 core machine its CPU pool gets 1 worker while its model-loader pool asks for
    # 2, and quantize() stops with "requests 2 workers but parent 'cpu' only has 1".
    if (os.cpu_count() or 1) <= 3:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def _keep_logs_in(folder: Path) -> None:
    """gptqmodel writes per-layer statistics under ./logs of whatever folder the user runs
    from; keep them with the model they describe instead."""
    from gptqmodel.looper import loop_processor

    if hasattr(loop_processor, "_PROJECT_LOG_DIR"):
        folder.mkdir(parents=True, exist_ok=True)
        loop_processor._PROJECT_LOG_DIR = folder
