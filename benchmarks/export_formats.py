"""Every export format of one model, side by side: size on disk, export time, load time and
perplexity on a held-out text (docs/benchmarks.md, "Export formats").

    python benchmarks/export_formats.py                       # the packaged default model
    python benchmarks/export_formats.py --ckpt_dir RUN        # a LoRA run (merged first)
    python benchmarks/export_formats.py --only gguf-f16 bnb-4 # some rows
    python benchmarks/export_formats.py --only gptq-4 awq-4   # needs `pip install swiftlm[gptq]`

Each export runs as `swiftlm export` in its own process; each artifact is then loaded and
measured in a fresh process with the loader a user would use (transformers for Hugging Face
folders and GGUF files, onnxruntime for ONNX), so one measurement cannot warm the next.
Perplexity is exp(mean next-token NLL) over the held-out text in `swiftlm/assets`, in
512-token windows, computed the same way for every format. Load times include reading the
files from the page cache (each artifact was just written), not from a cold disk.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> swiftlm export flags
FORMATS = {
    "merged-hf": ["--merge_lora", "true"],
    "gguf-f16": ["--to_gguf", "true", "--gguf_type", "f16"],
    "gguf-bf16": ["--to_gguf", "true", "--gguf_type", "bf16"],
    "gguf-q8_0": ["--to_gguf", "true", "--gguf_type", "q8_0"],
    "gguf-q4_0": ["--to_gguf", "true", "--gguf_type", "q4_0"],
    "bnb-8": ["--quant_method", "bnb", "--quant_bits", "8"],
    "bnb-4": ["--quant_method", "bnb", "--quant_bits", "4"],
    "torchao-int8": ["--quant_method", "int8"],
    "torchao-int4": ["--quant_method", "int4"],
    "onnx": ["--to_onnx", "true"],
    # GPT-QModel (the optional `gptq` extra); SmolLM2's 576-wide layers need group size 64.
    "gptq-4": ["--quant_method", "gptq", "--quant_bits", "4", "--group_size", "64"],
    "gptq-8": ["--quant_method", "gptq", "--quant_bits", "8", "--group_size", "64"],
    "awq-4": ["--quant_method", "awq", "--group_size", "64"],
}
CALIBRATED = ("gptq-4", "gptq-8", "awq-4")


def artifact_bytes(name: str, folder: Path) -> int:
    """What a user ships: the GGUF file alone, or the whole folder (weights + tokenizer)."""
    from swiftlm.export.checks import folder_bytes

    if name.startswith("gguf"):
        return sum(f.stat().st_size for f in folder.glob("*.gguf"))
    return folder_bytes(folder)


def run_export(flags: list[str], source: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "swiftlm", "export", *source, *flags, "--output_dir", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return seconds


def load_artifact(kind: str, folder: Path):
    """(model, tokenizer) the way a user loads this format."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if kind == "onnx":
        from swiftlm.export.onnx_check import OnnxCausalLM  # feeds an empty KV cache

        return OnnxCausalLM(folder / "model.onnx"), AutoTokenizer.from_pretrained(folder)
    gguf = sorted(folder.glob("*.gguf"))
    # A GGUF file is de-quantized into float32; a quantized folder runs its unquantized
    # weights in the dtype it was saved with (torchao's int4 CPU kernel needs its bf16).
    kwargs = {"gguf_file": gguf[0].name, "dtype": torch.float32} if gguf else {"dtype": "auto"}
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return model, AutoTokenizer.from_pretrained(
        folder, **({"gguf_file": gguf[0].name} if gguf else {})
    )


def measure(kind: str, path: str) -> dict:
    """Runs in a fresh process: load the artifact, then its perplexity on the held-out text."""
    import torch

    from swiftlm.export.checks import perplexity

    torch.set_num_threads(os.cpu_count() or 1)
    import transformers  # noqa: F401  (imports are not load time)

    if kind == "onnx":
        import onnxruntime  # noqa: F401
    start = time.perf_counter()
    model, tokenizer = load_artifact(kind, Path(path))
    load_seconds = time.perf_counter() - start
    return {"load_s": load_seconds, "ppl": perplexity(model, tokenizer)}


def measure_in_subprocess(kind: str, path: Path) -> dict:
    cmd = [sys.executable, __file__, "--measure", kind, str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def source_folder(args) -> tuple[list[str], Path]:
    """The export flags naming the source, and a Hugging Face folder of its full weights."""
    if args.ckpt_dir:
        return ["--ckpt_dir", args.ckpt_dir], Path()  # the merged-hf row is the reference
    from swiftlm.models.loader import resolve_model

    resolved = resolve_model(args.model)
    return (["--model", args.model] if args.model else []), Path(resolved.path)


def table(rows: list[dict]) -> str:
    lines = [
        "| format | size on disk | export | load | perplexity | change |",
        "|---|---|---|---|---|---|",
    ]
    reference = rows[0]["ppl"]
    for row in rows:
        change = (row["ppl"] / reference - 1) * 100
        lines.append(
            f"| {row['format']} | {row['bytes'] / 2**20:.0f} MiB | {row['export_s']:.0f} s "
            f"| {row['load_s']:.1f} s | {row['ppl']:.3f} | {change:+.2f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to export (default: packaged)")
    parser.add_argument("--ckpt_dir", default=None, help="a LoRA run to merge and export")
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(FORMATS))
    parser.add_argument("--workdir", default=None, help="keep the exports here")
    parser.add_argument("--measure", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    source_flags, source = source_folder(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="swiftlm-export-bench-"))
    # Rows are kept in WORKDIR/results.json: rerunning some formats updates one table.
    names = args.only or [
        n for n in FORMATS if (n != "merged-hf" or args.ckpt_dir) and n not in CALIBRATED
    ]
    rows = []
    if not args.ckpt_dir:
        ref = {"format": "source (Hugging Face, float32)", "export_s": 0.0}
        ref["bytes"] = artifact_bytes("source", source)
        rows.append({**ref, **measure_in_subprocess("hf", source)})
        print(json.dumps(rows[-1]), flush=True)
    for name in names:
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        export_s = run_export(FORMATS[name], source_flags, out)
        kind = "onnx" if name == "onnx" else "hf"
        row = {"format": name, "export_s": export_s, "bytes": artifact_bytes(name, out)}
        rows.append({**row, **measure_in_subprocess(kind, out)})
        print(json.dumps(rows[-1]), flush=True)
    results = work / "results.json"
    saved = json.loads(results.read_text()) if results.is_file() else {}
    saved.update({row["format"]: row for row in rows})
    results.write_text(json.dumps(saved, indent=1))
    print(table(list(saved.values())))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
