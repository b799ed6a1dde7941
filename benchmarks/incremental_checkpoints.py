"""Bytes written per checkpoint and load time: today's format against --incremental_checkpoints.

    python benchmarks/incremental_checkpoints.py            # SmolLM2-135M-Instruct (packaged)
    python benchmarks/incremental_checkpoints.py --model tiny --steps 6 --save_steps 2

Three jobs, each trained twice (standard and block format) with the same flags: a LoRA run, a
full fine-tuning run with frozen embeddings (--freeze_parameters model.embed_tokens; the
model's output head is tied to them, so it stays frozen too), and partial fine-tuning with
the lower half of the layers frozen too (layers 0-14 of SmolLM2-135M's 30; the job needs a
model of 15 layers or more, so `--model tiny` runs `--jobs 0 1`). A checkpoint's bytes written
are, in the standard format, the size of its folder; in block format, its folder's own files
plus the blocks no earlier checkpoint of the run references (those are the only ones the save
wrote). Load time is reading the last checkpoint's weights and optimizer state back
(`read_weights` + `read_optimizer`: safetensors files or blocks), the median of 5 reads with
a warm page cache. Each run is its own `swiftlm sft` process; times are wall clock on this
machine. Also printed: the hashing throughput here (every save hashes every block).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

JOBS = {
    "LoRA": {"train_type": "lora"},
    "full, frozen embeddings": {
        "train_type": "full",
        "freeze_parameters": "model.embed_tokens",
        "learning_rate": "1e-5",
    },
    # Partial fine-tuning: the embeddings and the lower half of SmolLM2's 30 layers frozen.
    "full, frozen embeddings + layers 0-14": {
        "train_type": "full",
        "freeze_parameters": " ".join(
            ["model.embed_tokens", *(f"model.layers.{i}" for i in range(15))]
        ),
        "learning_rate": "1e-5",
    },
}


def chat_rows(count: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} times 7?"},
                {"role": "assistant", "content": f"{i} times 7 is {i * 7}."},
            ]
        }
        for i in range(count)
    ]


def model_flags(model: str, workdir: Path) -> list[str]:
    """`--model` for the run: the packaged default (no flag), a path, or the test suite's
    tiny Llama built into `workdir`."""
    if model == "default":
        return []
    if model in ("tiny", "medium"):
        from conftest import build_tokenizer, make_tiny_llama

        folder = workdir / f"{model}-llama"
        folder.mkdir(exist_ok=True)
        vocab = len(build_tokenizer(folder))
        if model == "tiny":  # the test suite's: 2 layers, hidden 64
            make_tiny_llama(vocab).save_pretrained(folder)
        else:  # 8 layers, hidden 512: 21M parameters, a 0.25 GB full checkpoint (float32)
            medium_llama(vocab).save_pretrained(folder)
        return ["--model", str(folder)]
    return ["--model", model]


def medium_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def train(out: Path, model: list[str], data: Path, flags: dict, args) -> None:
    launcher = "import sys; from swiftlm.cli.main import main; sys.exit(main())"
    argv = [sys.executable, "-c", launcher, "sft", *model, "--dataset", str(data)]
    argv += ["--output_dir", str(out), "--report_to", "none", "--max_length", "64"]
    argv += ["--max_steps", str(args.steps), "--save_steps", str(args.save_steps)]
    for name, value in flags.items():
        argv += [f"--{name}", *str(value).split()]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise SystemExit(f"swiftlm sft failed ({done.returncode}):\n{done.stdout[-3000:]}")
    print(f"  trained {out.name} in {time.perf_counter() - started:.0f} s", flush=True)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def bytes_written(run: Path) -> list[tuple[int, int]]:
    """(step, bytes the save wrote) per checkpoint of a run, oldest first."""
    from swiftlm.checkpoint import blocks

    written, seen = [], set()
    folders = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    for folder in folders:
        own = folder_bytes(folder)
        if blocks.is_block_checkpoint(folder):
            manifest = blocks.read_manifest(folder)
            sizes = {d: s for g in manifest["groups"].values() for d, s in g["blocks"]}
            own += sum(size for digest, size in sizes.items() if digest not in seen)
            seen |= set(sizes)
        written.append((int(folder.name[5:]), own))
    return written


def load_seconds(folder: Path) -> tuple[float, float]:
    """(read, read and touch every byte) of a checkpoint's weights and optimizer state, the
    median of 5. Safetensors files are memory-mapped: reading them is lazy, and their bytes
    come from the page cache only when used (a resume copies them into the model); blocks
    are read into memory at once. Touching every byte puts both on the same footing."""
    from swiftlm.checkpoint.tensors import read_optimizer, read_weights

    reads, touched = [], []
    for _ in range(5):
        started = time.perf_counter()
        tensors = [*read_weights(folder).values(), *read_optimizer(folder)["state"].values()]
        reads.append(time.perf_counter() - started)
        for tensor in tensors:
            for value in tensor.values() if isinstance(tensor, dict) else [tensor]:
                if hasattr(value, "reshape"):
                    value.reshape(-1).view(torch.uint8).sum()
        touched.append(time.perf_counter() - started)
        del tensors
    return statistics.median(reads), statistics.median(touched)


def hash_throughput(name: str) -> float:
    """A hash over 256 MiB of 4 MiB blocks, one thread: MB/s."""
    block = os.urandom(4 * 1024 * 1024)
    started = time.perf_counter()
    for _ in range(64):
        hashlib.new(name, block).hexdigest()
    return 64 * 4 * 1024 * 1024 / (time.perf_counter() - started) / 1e6


def mb(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="default", help="default (SmolLM2-135M), tiny, or a path"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--jobs", nargs="*", type=int, help="indexes of JOBS to run (default: all)")
    parser.add_argument(
        "--measure_only", action="store_true", help="measure the runs already in --workdir"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swiftlm-incremental-") as temp:
        workdir = Path(args.workdir or temp)
        workdir.mkdir(parents=True, exist_ok=True)
        model = model_flags(args.model, workdir)
        data = workdir / "chat.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in chat_rows(64)) + "\n")
        rows = []
        chosen = [list(JOBS)[i] for i in args.jobs] if args.jobs else list(JOBS)
        for job in chosen:
            flags, runs = JOBS[job], {}
            for fmt in ("standard", "incremental"):
                out = workdir / f"job{list(JOBS).index(job)}-{fmt}"
                if not args.measure_only:
                    incremental = {"incremental_checkpoints": fmt != "standard"}
                    train(out, model, data, {**flags, **incremental}, args)
                runs[fmt] = out
            rows.append(report(job, runs))
        print(f"\nmodel: {args.model}; {args.steps} steps, a checkpoint every {args.save_steps}\n")
        print(
            "| job | format | first checkpoint | each later one (mean) | all checkpoints "
            "| load: read | load: read + touch every byte |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(row)
        speeds = ", ".join(f"{n} {hash_throughput(n):,.0f}" for n in ("sha256", "blake2b"))
        print(f"\nhashing on one core here, MB/s: {speeds} (blocks are named by sha256)")


def report(job: str, runs: dict) -> str:
    lines = []
    for fmt, run in runs.items():
        written = [size for _, size in bytes_written(run)]
        later = statistics.mean(written[1:]) if len(written) > 1 else float("nan")
        newest = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
        read, touched = load_seconds(newest)
        lines.append(
            f"| {job} | {fmt} | {mb(written[0])} | {mb(int(later))} | {mb(sum(written))} "
            f"| {read:.3f} s | {touched:.3f} s |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
