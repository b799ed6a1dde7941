"""Peak memory per rank of each distribution strategy, side by side, on one machine.

Full fine-tuning of the packaged SmolLM2-135M-Instruct (fp32 weights + AdamW states: ~2.2 GB
of model state) for a few steps with 2 processes (gloo on CPU, NCCL on GPUs), one run per
strategy. What it shows is how the model state per rank shrinks as more of it is sharded:
DDP replicates everything, ZeRO-2 shards optimizer states and gradients, FSDP2 and ZeRO-3 also
shard the weights, TP splits the block weights. (Pipeline parallel is not in the table:
SmolLM2 ties its embeddings to its LM head, which would sit on different stages.)

    python benchmarks/distributed_memory.py [--steps 3] [--nproc 2] [--strategies ddp fsdp2 ...]

Prints a Markdown table (peak memory of rank 0: RSS on CPU, CUDA allocator peak on GPU) and
the ratio to DDP. Memory, unlike time, is not disturbed by other work on a shared machine.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = {
    "single (1 process)": [],
    "ddp": ["--nproc_per_node", "{n}"],
    "deepspeed zero2": ["--nproc_per_node", "{n}", "--deepspeed", "zero2"],
    "deepspeed zero3": ["--nproc_per_node", "{n}", "--deepspeed", "zero3"],
    "fsdp2": ["--nproc_per_node", "{n}", "--fsdp", "fsdp2"],
    "tp": ["--nproc_per_node", "{n}", "--tensor_parallel_size", "{n}"],
}


def run_one(name: str, extra: list[str], steps: int, nproc: int, port: int, out: Path) -> dict:
    run_dir = out / name.replace(" ", "_").replace("(", "").replace(")", "")
    command = [
        sys.executable,
        "-m",
        "swiftlm",
        "sft",
        "--dataset",
        "swiftlm/general-qa",
        "--train_type",
        "full",
        "--torch_dtype",
        "float32",
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        "2",
        "--max_length",
        "128",
        "--logging_steps",
        "1",
        "--save_steps",
        "100000",
        "--report_to",
        "none",
        "--output_dir",
        str(run_dir),
        "--master_port",
        str(port),
        *[a.format(n=nproc) for a in extra],
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        lines = (result.stdout + result.stderr).splitlines()
        reason = next((line for line in lines if "swiftlm sft: error:" in line), lines[-1:])
        return {"name": name, "error": reason}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "memory_gib" in r][-1]
    return {
        "name": name,
        "memory_gib": last["memory_gib"],
        "loss": last["loss"],
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.strategies):
            results.append(
                run_one(name, STRATEGIES[name], args.steps, args.nproc, 29700 + i, Path(tmp))
            )
            print(results[-1], file=sys.stderr, flush=True)
    ddp = next((r["memory_gib"] for r in results if r["name"] == "ddp" and "memory_gib" in r), None)
    print(
        f"| strategy ({args.nproc} processes) | peak memory of rank 0 (GiB) | vs DDP | loss after {args.steps} steps |"
    )
    print("|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | not run: {r['error']} | | |")
            continue
        ratio = f"{r['memory_gib'] / ddp:.2f}x" if ddp else ""
        print(f"| {r['name']} | {r['memory_gib']:.2f} | {ratio} | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
