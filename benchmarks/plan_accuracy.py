"""How close `swiftlm plan` is to real runs on this machine's CPUs.

Runs real `swiftlm sft` jobs with 2 processes (gloo) for a few steps: LoRA and full, DDP,
DeepSpeed ZeRO-2/3 and FSDP2, with and without gradient checkpointing, on the packaged
SmolLM2-135M-Instruct and on a ~100M-parameter Llama built here from a config (random
weights, saved to a temporary folder with SmolLM2's tokenizer). For each run it records the
peak RSS of every rank (polling each worker's VmHWM, the kernel's high-water mark) and the
median step time after the first step, and prints the planner's estimate next to them.

Then decision cases: for each job measured with several strategies and each memory budget
between their measured peaks, does `swiftlm plan` (restricted to those strategies, with that
budget) recommend the fastest measured strategy among those whose measured peak fits?

    python benchmarks/plan_accuracy.py [--quick] [--steps 5] [--out table.md]

--quick runs two configurations (used by tests/slow/test_plan_accuracy.py); --workdir keeps
the runs and their measurements (measured.json), --reuse re-estimates them without rerunning.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
PORTS = iter(range(30100, 30200))
SMOL = "SmolLM2-135M"
LLAMA100M = "Llama-100M"


@dataclass
class Config:
    model: str
    train_type: str
    strategy: str  # a planner layout name: DDP, ZeRO-2, ZeRO-3, FSDP2
    checkpointing: bool = False
    batch: int = 2
    max_length: int = 256
    measured_gib: list = field(default_factory=list)
    step_s: float = 0.0
    estimate_gib: float = 0.0
    estimate_s: float = 0.0

    @property
    def job(self) -> tuple:
        return (self.model, self.train_type, self.checkpointing, self.batch, self.max_length)

    def label(self) -> str:
        ckpt = " +ckpt" if self.checkpointing else ""
        return (
            f"{self.model} {self.train_type} {self.strategy}{ckpt} B{self.batch} L{self.max_length}"
        )


STRATEGY_FLAGS = {
    "DDP": ["--strategy", "ddp"],
    "ZeRO-2": ["--deepspeed", "zero2"],
    "ZeRO-3": ["--deepspeed", "zero3"],
    "FSDP2": ["--fsdp", "fsdp2"],
}


def configurations(quick: bool) -> list[Config]:
    if quick:
        # one full and one LoRA run among those the estimate meets in the full table
        return [
            Config(SMOL, "full", "DDP"),
            Config(LLAMA100M, "lora", "ZeRO-2", batch=4, max_length=512),
        ]
    grid = [Config(SMOL, "full", s) for s in STRATEGY_FLAGS]
    grid += [Config(LLAMA100M, "full", s, checkpointing=True) for s in STRATEGY_FLAGS]
    grid += [
        Config(SMOL, "full", "FSDP2", checkpointing=True),
        Config(SMOL, "lora", "DDP", batch=4, max_length=512),
        Config(SMOL, "lora", "DDP", checkpointing=True, batch=4, max_length=512),
        Config(SMOL, "lora", "ZeRO-3", checkpointing=True, batch=4, max_length=512),
        Config(LLAMA100M, "lora", "ZeRO-2", batch=4, max_length=512),
    ]
    return grid


def build_llama_100m(folder: Path) -> Path:
    """A Llama with ~100M parameters (untied head) and SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftlm.models.loader import resolve_model

    smol = resolve_model(None).path
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smol).save_pretrained(folder)
    return folder


def write_data(path: Path) -> Path:
    """Samples longer than any --max_length used, cut to it (--truncation_strategy right),
    so every micro-batch has exactly batch x max_length tokens."""
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "river",
        "mountain",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
    ]
    with path.open("w") as f:
        for i in range(200):
            answer = " ".join(words[(i * 7 + j) % len(words)] for j in range(1500))
            messages = [
                {"role": "user", "content": f"Question {i}: say many words."},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def worker_peaks(root_pid: int, peaks: dict) -> None:
    """Fold the VmHWM (peak RSS) of every torchrun worker under `root_pid` into `peaks`."""
    import psutil

    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:  # a worker may exit (or be a zombie) between listing and reading it
            rank = child.environ().get("RANK")
            status = Path(f"/proc/{child.pid}/status").read_text()
            launcher = "swiftlm.distributed.torchrun" in " ".join(child.cmdline())
        except (psutil.Error, OSError):
            continue
        if rank is None or launcher:
            continue
        hwm = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM"))
        peaks[int(rank)] = max(peaks.get(int(rank), 0), hwm * 1024)


def run_config(config: Config, models: dict, data: Path, steps: int, out: Path) -> None:
    run_dir = out / config.label().replace(" ", "_").replace("+", "")
    command = [
        *[sys.executable, "-m", "swiftlm", "sft", "--dataset", str(data)],
        *(["--model", models[config.model]] if models[config.model] else []),
        *["--train_type", config.train_type, "--max_steps", str(steps)],
        *["--per_device_train_batch_size", str(config.batch)],
        *["--max_length", str(config.max_length), "--truncation_strategy", "right"],
        *["--gradient_checkpointing", str(config.checkpointing).lower(), "--lora_dropout", "0"],
        *["--logging_steps", "1", "--save_steps", "100000", "--report_to", "none"],
        *["--output_dir", str(run_dir), "--nproc_per_node", "2"],
        *["--master_port", str(next(PORTS)), *STRATEGY_FLAGS[config.strategy]],
    ]
    peaks: dict = {}
    with open(out / "runs.log", "a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            worker_peaks(process.pid, peaks)
            time.sleep(0.1)
    if process.returncode != 0:
        raise RuntimeError(f"{config.label()} failed: see {out / 'runs.log'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [row["time/step_s"] for row in rows if "time/step_s" in row][1:]
    config.measured_gib = [peaks[rank] / GIB for rank in sorted(peaks)]
    config.step_s = statistics.median(times)
    for folder in ("checkpoints", "final"):  # ~1.5 GB a run: keep only the logs
        shutil.rmtree(run_dir / folder, ignore_errors=True)


def estimate(config: Config, models: dict, only: list[str], budget_gib: float | None = None):
    """The planner's plan for `config`'s job on 2 CPU processes."""
    from swiftlm.plan.devices import parse_devices
    from swiftlm.plan.memory import Job
    from swiftlm.plan.planner import make_plan
    from swiftlm.plan.run import compute_bytes
    from swiftlm.plan.shape import (
        checkpoint_bytes,
        count_parameters,
        load_model_config,
        model_shape,
    )
    from swiftlm.tuners.config import TunerArguments

    key = (config.model, config.train_type)
    if key not in SHAPES:
        model_config, name = load_model_config(models[config.model])
        params = count_parameters(model_config, TunerArguments(train_type="full"))[0]
        stored = checkpoint_bytes(models[config.model], model_config, params)
        tuner = TunerArguments(train_type=config.train_type)
        SHAPES[key] = model_shape(model_config, tuner, name, stored)
    job = Job(
        batch_size=config.batch,
        max_length=config.max_length,
        checkpointing=config.checkpointing,
        full=config.train_type == "full",
        compute_bytes=compute_bytes("auto", "cpu"),
    )
    return make_plan(SHAPES[key], job, parse_devices("2xcpu", 1, budget_gib), only)


SHAPES: dict = {}


def fill_estimate(config: Config, models: dict) -> None:
    plan = estimate(config, models, [config.strategy])
    (candidate,) = plan.candidates
    config.estimate_gib = candidate.memory.peak / GIB
    config.estimate_s = candidate.time.total_s


def accuracy_table(configs: list[Config]) -> list[str]:
    lines = [
        "| configuration (2 CPU processes) | estimate GiB | measured GiB (rank 0, rank 1) "
        "| error | est. step s | measured step s |",
        "|---|---|---|---|---|---|",
    ]
    for c in configs:
        measured = max(c.measured_gib)
        error = (c.estimate_gib - measured) / measured
        ranks = ", ".join(f"{m:.2f}" for m in c.measured_gib)
        lines.append(
            f"| {c.label()} | {c.estimate_gib:.2f} | {measured:.2f} ({ranks}) | {error:+.1%} "
            f"| {c.estimate_s:.2f} | {c.step_s:.2f} |"
        )
    return lines


def decision_cases(configs: list[Config], models: dict) -> tuple[list[str], int, int]:
    """Budgets between the measured peaks of each job measured with several strategies."""
    lines = [
        "| job | budget GiB/process | fits (measured) | fastest measured | planner | hit |",
        "|---|---|---|---|---|---|",
    ]
    hits = total = 0
    jobs: dict = {}
    for c in configs:
        jobs.setdefault(c.job, []).append(c)
    for group in (g for g in jobs.values() if len(g) >= 3):
        peaks = sorted(max(c.measured_gib) for c in group)
        budgets = [(a + b) / 2 for a, b in zip(peaks, peaks[1:], strict=False)] + [peaks[-1] * 1.1]
        for budget in budgets:
            fitting = [c for c in group if max(c.measured_gib) <= budget]
            fastest = min(fitting, key=lambda c: c.step_s).strategy
            plan = estimate(group[0], models, [c.strategy for c in group], budget)
            chosen = plan.best.layout.name if plan.best else "nothing fits"
            hits, total = hits + (chosen == fastest), total + 1
            names = ", ".join(c.strategy for c in fitting)
            job = group[0].label().replace(f" {group[0].strategy}", "")
            lines.append(
                f"| {job} | {budget:.2f} | {names} | {fastest} | {chosen} | "
                f"{'yes' if chosen == fastest else 'no'} |"
            )
    return lines, hits, total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take the measurements already in --workdir/measured.json; run only the others",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        out = Path(args.workdir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        llama = out / "llama100m"
        built = (llama / "config.json").is_file() and args.reuse
        models = {SMOL: None, LLAMA100M: str(llama if built else build_llama_100m(llama))}
        data = write_data(out / "long.jsonl")
        configs = configurations(args.quick)
        saved = out / "measured.json"
        measured = json.loads(saved.read_text()) if args.reuse and saved.is_file() else {}
        for config in configs:
            started = time.perf_counter()
            if config.label() in measured:  # --reuse: re-estimate earlier measurements
                config.measured_gib, config.step_s = measured[config.label()]
            else:
                run_config(config, models, data, args.steps, out)
                measured[config.label()] = [config.measured_gib, config.step_s]
                saved.write_text(json.dumps(measured, indent=1))
            fill_estimate(config, models)
            print(f"{config.label()}: {time.perf_counter() - started:.0f} s", flush=True)
        lines = ["## Memory and step time: estimate vs measured", "", *accuracy_table(configs)]
        errors = [abs(c.estimate_gib - max(c.measured_gib)) / max(c.measured_gib) for c in configs]
        within = sum(e <= 0.15 for e in errors)
        lines += ["", f"Within 15%: {within} of {len(configs)} configurations.", ""]
        cases, hits, total = decision_cases(configs, models)
        if total:
            lines += ["## Recommendation vs fastest measured that fits", "", *cases, ""]
            lines.append(f"Recommendation hits: {hits} of {total} decision cases.")
        text = "\n".join(lines)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(
            json.dumps({"max_error": max(errors), "within": within, "hits": hits, "cases": total})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
