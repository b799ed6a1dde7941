"""Optimizer-state memory, peak RSS and step time of every `--optim` vs AdamW, on the default
model (SmolLM2-135M-Instruct), full fine-tuning and LoRA side by side.

    python benchmarks/optimizers.py [--steps 4] [--seq 256] [--only adamw_torch,muon]

Each (optimizer, train type) runs in a fresh subprocess (peak RSS is a per-process high-water
mark) that loads the model in float32, builds the optimizer with swiftlm's `build_optimizer`
(the settings `swiftlm sft --optim NAME` uses; LoRA: rank 8 on every linear layer), and runs
`--steps` training steps on one row of `--seq` random tokens. Reported per run:

- state B/param: bytes of the optimizer's state tensors (its checkpointed `state_dict()`:
  moments, quantization maps, projections) per trainable parameter, after the first step;
- peak RSS: the process's peak resident memory (ru_maxrss) over the whole run;
- opt step / train step: medians over the steps after the first (which allocates the state,
  and for GaLore computes its SVDs) of the optimizer step alone and of forward + backward +
  optimizer step.

Ratios are against adamw_torch of the same train type. GaLore and APOLLO project full weight
matrices' gradients and are refused with LoRA (`--train_type full` only).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_8bit",
    "paged_adamw_8bit",
    "adafactor",
    "muon",
    "schedule_free_adamw",
    "galore_adamw",
    "apollo_adamw",
)
FULL_ONLY = ("galore_adamw", "apollo_adamw")
LEARNING_RATE = {"full": 1e-5, "lora": 1e-4}  # swiftlm's defaults per train type


# ---- one measurement (runs in its own process) ----------------------------------------------


def load_model(train_type: str):
    import torch
    from transformers import AutoModelForCausalLM

    from swiftlm.models.loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.float32)
    if train_type == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
        model = get_peft_model(model, config)
    return model.train()


def state_bytes(optimizer) -> int:
    """Bytes of the tensors in the optimizer's state dict, each storage counted once."""
    import torch

    seen, total = set(), 0
    for entry in optimizer.state_dict()["state"].values():
        for value in entry.values():
            if torch.is_tensor(value) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def measure(optim: str, train_type: str, steps: int, seq: int) -> dict:
    import torch

    from swiftlm.train.config import TrainArguments
    from swiftlm.train.optim import build_optimizer

    torch.manual_seed(0)
    model = load_model(train_type)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    args = TrainArguments(optim=optim, learning_rate=LEARNING_RATE[train_type])
    optimizer = build_optimizer(model, args, num_steps=steps)
    if hasattr(optimizer, "train"):
        optimizer.train()  # schedule-free: train mode before stepping
    ids = torch.randint(0, model.config.vocab_size, (1, seq))
    optimizer_s, step_s, state = [], [], 0
    for step in range(steps):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        stepping = time.perf_counter()
        optimizer.step()
        done = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        optimizer_s.append(done - stepping)
        step_s.append(done - started)
        if step == 0:
            state = state_bytes(optimizer)
    return {
        "optim": optim,
        "train_type": train_type,
        "trainable": trainable,
        "state_bytes": state,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "optimizer_s": statistics.median(optimizer_s[1:]),
        "step_s": statistics.median(step_s[1:]),
    }


# ---- the table ------------------------------------------------------------------------------


def run_one(optim: str, train_type: str, args) -> dict:
    command = [sys.executable, __file__, "--one", optim, train_type]
    command += ["--steps", str(args.steps), "--seq", str(args.seq)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{optim} ({train_type}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def table(results: list[dict]) -> str:
    lines = [
        "| train type | --optim | state B/param | vs AdamW | peak RSS (MiB) | vs AdamW "
        "| opt step (ms) | vs AdamW | train step (ms) | vs AdamW |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["train_type"]: r for r in results if r["optim"] == "adamw_torch"}
    for r in results:
        b = base[r["train_type"]]
        per_param, base_per_param = (
            r["state_bytes"] / r["trainable"],
            b["state_bytes"] / b["trainable"],
        )
        rss, base_rss = r["peak_rss"] / 2**20, b["peak_rss"] / 2**20
        lines.append(
            f"| {r['train_type']} | {r['optim']} | {per_param:.2f} "
            f"| {ratio(per_param, base_per_param)} | {rss:,.0f} | {ratio(rss, base_rss)} "
            f"| {r['optimizer_s'] * 1e3:,.0f} | {ratio(r['optimizer_s'], b['optimizer_s'])} "
            f"| {r['step_s'] * 1e3:,.0f} | {ratio(r['step_s'], b['step_s'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (>= 2)")
    parser.add_argument("--seq", type=int, default=256, help="tokens in the one training row")
    parser.add_argument("--only", default=",".join(OPTIMIZERS), help="comma-separated --optim")
    parser.add_argument("--one", nargs=2, metavar=("OPTIM", "TRAIN_TYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.steps, args.seq)))
        return
    names = ["adamw_torch", *(n for n in args.only.split(",") if n != "adamw_torch")]
    results = []
    for train_type in ("full", "lora"):
        for optim in names:
            if train_type == "lora" and optim in FULL_ONLY:
                continue
            results.append(run_one(optim, train_type, args))
            print(f"  {train_type} {optim}: {results[-1]}", file=sys.stderr, flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
