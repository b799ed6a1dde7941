"""swiftlm vs ms-swift vs TRL: LoRA and full SFT throughput on the same local model and data.

    python3 benchmarks/frameworks/run.py [--steps 20] [--repeats 2] [--modes lora,full]
        [--frameworks swiftlm,ms-swift,trl] [--dtype bf16|fp32|default] [--skip-setup]

Sets up the framework venvs (setup_envs.sh) and the assets (make_assets.py) when missing, then
for each mode runs the frameworks in turn (swiftlm, ms-swift, trl, swiftlm, ...) `--repeats`
times, each in a fresh process, and prints one Markdown table per mode with medians and
swiftlm/other ratios. Raw runs go to results/<timestamp>.json, the tables to results/latest.md,
the logs of each run to runs/<timestamp>/. Standard library only: any python3 runs it.
See README.md for the metric definitions and the matched settings.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch import OFFLINE_ENV, failure_reason, launch, read_steps

# Extra flags for every swiftlm run (e.g. ["--padding_free", "true"]): swiftlm's speed-ups
# that have no counterpart in the other frameworks' settings. The table header lists them.
SWIFTLM_EXTRA_FLAGS: list[str] = []

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ASSETS = HERE / ".assets"
VENVS = HERE / ".venvs"
SWIFTLM_VENV = REPO / ".venv"
FRAMEWORKS = ["swiftlm", "ms-swift", "trl"]
ENV_OF = {"ms-swift": "msswift", "trl": "trl"}  # framework -> venv made by setup_envs.sh
LEARNING_RATE = {"lora": 1e-4, "full": 1e-5}
MAX_LENGTH, BATCH_SIZE, SEED = 512, 4, 42
LORA_RANK, LORA_ALPHA = 8, 32
# ms-swift and swiftlm default to beta2 0.95, the HF Trainer to 0.999: pinned for all three.
ADAM_BETA2 = 0.95
LOSS_WINDOW = 5  # final loss = mean of the last 5 steps


@dataclass
class Run:
    """One framework run: its measurements, or why it has none."""

    framework: str
    mode: str
    round: int
    ok: bool = False
    error: str = ""
    time_to_first_step_s: float | None = None
    label_tokens_per_s: float | None = None
    peak_rss_gib: float | None = None
    final_loss: float | None = None
    steps: int = 0
    seconds_per_step: float | None = None
    label_tokens_per_sample: float | None = None
    wall_s: float | None = None
    exit_code: int | None = None
    # 1-minute load average when the run ended; the run itself accounts for ~2 (its torch
    # threads): clearly more means other work shared the CPUs during the measurement.
    load_avg_end: float | None = None
    log_dir: str = ""
    losses: list = field(default_factory=list)


# ---------------------------------------------------------------- setup


def ensure_envs(frameworks: list[str], skip_setup: bool) -> dict[str, str]:
    """Create missing venvs; return {framework: reason} for the ones that cannot run."""
    broken = {}
    if not (SWIFTLM_VENV / "bin" / "swiftlm").exists() and "swiftlm" in frameworks:
        broken["swiftlm"] = f"{SWIFTLM_VENV}/bin/swiftlm not found (run scripts/setup.sh)"
    wanted = [ENV_OF[f] for f in frameworks if f in ENV_OF]
    if not (ASSETS / "manifest.json").exists():
        wanted.append("corpus")  # only make_assets.py reads it
    missing = [env for env in wanted if not (VENVS / env / ".ok").exists()]
    if missing and not skip_setup:
        print(f"[setup] creating venvs: {', '.join(missing)} (minutes, once)", flush=True)
        subprocess.run(["bash", str(HERE / "setup_envs.sh"), *missing], check=False)
    for framework in frameworks:
        env = ENV_OF.get(framework)
        if env and not (VENVS / env / ".ok").exists():
            broken[framework] = f"venv {VENVS / env} not installed (see {VENVS / env}.log)"
    return broken


def ensure_assets() -> None:
    """Build the model, tokenizer and data once; they are deterministic, so reuse is safe."""
    if (ASSETS / "manifest.json").exists():
        return
    print(f"[assets] building {ASSETS} ...", flush=True)
    result = subprocess.run(
        [str(SWIFTLM_VENV / "bin" / "python"), str(HERE / "make_assets.py"), "--out", str(ASSETS)],
        env={**os.environ, **OFFLINE_ENV},
        check=False,
    )
    if result.returncode != 0 or not (ASSETS / "manifest.json").exists():
        sys.exit("[assets] make_assets.py failed; no framework can run without the assets")


# ---------------------------------------------------------------- commands


# `default`: each framework as it runs out of the box on this fp32 checkpoint. swiftlm picks
# bf16 autocast itself on CPUs with native bf16 matmul (fp32 elsewhere); ms-swift and TRL
# train in the checkpoint's float32 unless told otherwise.
SWIFTLM_PRECISION = {
    "bf16": ["--torch_dtype", "bfloat16"],
    "fp32": ["--torch_dtype", "float32"],
    "default": [],
}


def swiftlm_command(mode: str, steps: int, dtype: str, out: Path) -> list[str]:
    return [
        str(SWIFTLM_VENV / "bin" / "swiftlm"), "sft",
        "--model", str(ASSETS / "model"), "--dataset", str(ASSETS / "train.jsonl"),
        "--train_type", mode, "--lora_rank", str(LORA_RANK), "--lora_alpha", str(LORA_ALPHA),
        "--lora_dropout", "0", "--target_modules", "all-linear",
        "--max_length", str(MAX_LENGTH), "--truncation_strategy", "right",
        "--per_device_train_batch_size", str(BATCH_SIZE), "--gradient_accumulation_steps", "1",
        "--max_steps", str(steps), "--learning_rate", str(LEARNING_RATE[mode]),
        "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--weight_decay", "0",
        "--adam_beta1", "0.9", "--adam_beta2", str(ADAM_BETA2), "--adam_epsilon", "1e-8",
        "--max_grad_norm", "1", "--gradient_checkpointing", "false",
        *SWIFTLM_PRECISION[dtype],
        "--logging_steps", "1", "--save_steps", "100000", "--report_to", "none",
        "--seed", str(SEED), "--data_seed", str(SEED), "--output_dir", str(out),
        *SWIFTLM_EXTRA_FLAGS,
    ]  # fmt: skip


def cpu_only() -> bool:
    """No CUDA GPU: the HF Trainer then needs use_cpu=True to run bf16 autocast on the CPU."""
    return shutil.which("nvidia-smi") is None


def msswift_command(mode: str, steps: int, dtype: str, out: Path) -> list[str]:
    # Offline, ms-swift needs --check_model false (else ~22 s of hub time-outs), an explicit
    # --model_type and --template (a local folder has no hub id to look them up by), and
    # --truncation_strategy right (its default drops over-long rows).
    # Its --torch_dtype float32 would turn on fp16 AMP, hence the explicit --fp16/--bf16.
    precision = (
        ["--torch_dtype", "bfloat16", "--bf16", "true", "--fp16", "false"]
        if dtype == "bf16"
        else ["--torch_dtype", "float32", "--bf16", "false", "--fp16", "false"]
    )
    return [
        str(VENVS / "msswift" / "bin" / "swift"), "sft",
        "--model", str(ASSETS / "model"), "--model_type", "llama", "--template", "chatml",
        "--check_model", "false", "--dataset", str(ASSETS / "train.jsonl"),
        "--tuner_type", mode, "--lora_rank", str(LORA_RANK), "--lora_alpha", str(LORA_ALPHA),
        "--lora_dropout", "0", "--target_modules", "all-linear",
        "--max_length", str(MAX_LENGTH), "--truncation_strategy", "right",
        "--per_device_train_batch_size", str(BATCH_SIZE), "--gradient_accumulation_steps", "1",
        "--max_steps", str(steps), "--learning_rate", str(LEARNING_RATE[mode]),
        "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--weight_decay", "0",
        "--adam_beta1", "0.9", "--adam_beta2", str(ADAM_BETA2), "--adam_epsilon", "1e-8",
        "--max_grad_norm", "1", "--gradient_checkpointing", "false", *precision,
        "--attn_impl", "sdpa", "--logging_steps", "1", "--save_strategy", "no",
        "--eval_strategy", "no", "--split_dataset_ratio", "0", "--report_to", "none",
        "--seed", str(SEED), "--data_seed", str(SEED), "--dataloader_num_workers", "0",
        "--dataset_num_proc", "1", "--output_dir", str(out), "--add_version", "false",
        *(["--use_cpu", "true"] if cpu_only() else []),
    ]  # fmt: skip


def trl_command(mode: str, steps: int, dtype: str, out: Path) -> list[str]:
    dtype = "fp32" if dtype == "default" else dtype
    return [
        str(VENVS / "trl" / "bin" / "python"), str(HERE / "trl_sft.py"),
        "--model", str(ASSETS / "model"), "--dataset", str(ASSETS / "train.jsonl"),
        "--mode", mode, "--steps", str(steps), "--learning_rate", str(LEARNING_RATE[mode]),
        "--dtype", dtype, "--output_dir", str(out), "--max_length", str(MAX_LENGTH),
        "--batch_size", str(BATCH_SIZE), "--lora_rank", str(LORA_RANK),
        "--lora_alpha", str(LORA_ALPHA), "--adam_beta2", str(ADAM_BETA2), "--seed", str(SEED),
    ]  # fmt: skip


COMMANDS = {"swiftlm": swiftlm_command, "ms-swift": msswift_command, "trl": trl_command}


# ---------------------------------------------------------------- measuring one run


def measure(run: Run, started: float, steps: list[dict], losses: dict[int, float]) -> None:
    """Fill in the metrics (definitions in README.md) from the per-step rows."""
    run.steps = len(steps)
    run.time_to_first_step_s = steps[0]["time"] - started
    run.losses = [losses[s["step"]] for s in steps if s["step"] in losses]
    if run.losses:
        run.final_loss = statistics.mean(run.losses[-LOSS_WINDOW:])
    if len(steps) >= 2:
        # Steady state: steps 2..N, timed from the end of step 1 to the end of step N.
        steady = steps[-1]["time"] - steps[0]["time"]
        tokens = sum(s["label_tokens"] for s in steps[1:])
        run.label_tokens_per_s = tokens / steady
        run.seconds_per_step = steady / (len(steps) - 1)
    run.label_tokens_per_sample = sum(s["label_tokens"] for s in steps) / (len(steps) * BATCH_SIZE)


def run_once(framework: str, mode: str, round_: int, args, root: Path, broken: dict) -> Run:
    run = Run(framework, mode, round_)
    if framework in broken:
        run.error = broken[framework]
        return run
    log_dir = root / f"{mode}-{framework}-{round_}"
    log_dir.mkdir(parents=True)
    run.log_dir = str(log_dir)
    out = log_dir / "output"
    command = COMMANDS[framework](mode, args.steps, args.dtype, out)
    (log_dir / "command.txt").write_text(" ".join(command) + "\n")
    started, code, peak, wall = launch(command, log_dir, args.timeout)
    run.exit_code, run.wall_s, run.peak_rss_gib = code, wall, peak / 2**30
    run.load_avg_end = os.getloadavg()[0]
    steps, losses = read_steps(log_dir / "steps.jsonl")
    if code != 0 or not steps:
        run.error = failure_reason(log_dir, code, args.timeout)
    elif len(steps) != args.steps:
        run.error = f"{len(steps)} steps recorded, {args.steps} expected"
    else:
        measure(run, started, steps, losses)
        run.ok = True
    # Saved weights and caches are of no use afterwards (full-mode weights are GBs): keep logs.
    subprocess.run(["rm", "-rf", str(out), str(log_dir / "cache")], check=False)
    return run


def describe(run: Run) -> str:
    if not run.ok:
        return f"FAILED ({run.error})"
    return (
        f"first step {run.time_to_first_step_s:.1f} s, {run.label_tokens_per_s:.0f} label tok/s "
        f"({run.seconds_per_step:.2f} s/step), peak RSS {run.peak_rss_gib:.2f} GiB, "
        f"final loss {run.final_loss:.4f} (load avg {run.load_avg_end:.1f})"
    )


# ---------------------------------------------------------------- summary

METRICS = [  # (Run field, column title, format)
    ("time_to_first_step_s", "time to first step (s)", "{:.1f}"),
    ("label_tokens_per_s", "label tokens/s", "{:.0f}"),
    ("peak_rss_gib", "peak RSS (GiB)", "{:.2f}"),
    ("final_loss", "final loss", "{:.4f}"),
]


def median_of(runs: list[Run], metric: str) -> float | None:
    values = [getattr(r, metric) for r in runs if r.ok and getattr(r, metric) is not None]
    return statistics.median(values) if values else None


def round_ratios(runs: list[Run], other: str, metric: str) -> list[float]:
    """swiftlm/other per round (run i of swiftlm with run i of the other)."""
    by_round = {(r.framework, r.round): r for r in runs if r.ok}
    ratios = []
    for (framework, round_), mine in by_round.items():
        theirs = by_round.get((other, round_))
        if framework == "swiftlm" and theirs and getattr(theirs, metric):
            ratios.append(getattr(mine, metric) / getattr(theirs, metric))
    return ratios


def mode_table(mode: str, runs: list[Run], frameworks: list[str]) -> str:
    header = "| framework | runs | " + " | ".join(title for _, title, _ in METRICS) + " |"
    lines = [header, "|---" * (len(METRICS) + 2) + "|"]
    for framework in frameworks:
        mine = [r for r in runs if r.framework == framework]
        good = [r for r in mine if r.ok]
        if not good:
            reason = (mine[0].error if mine else "not run").replace(
                "|", "\\|"
            )  # keep the table intact
            lines.append(f"| {framework} | 0/{len(mine)} | failed: {reason} |" + " |" * 3)
            continue
        cells = [fmt.format(median_of(good, m)) for m, _, fmt in METRICS]
        lines.append(f"| {framework} | {len(good)}/{len(mine)} | " + " | ".join(cells) + " |")
    for other in frameworks:
        if other == "swiftlm" or "swiftlm" not in frameworks:
            continue
        cells = []
        for metric, _, _ in METRICS:
            ratios = round_ratios(runs, other, metric)
            cells.append(f"{statistics.median(ratios):.2f}" if ratios else "n/a")
        lines.append(f"| swiftlm / {other} | | " + " | ".join(cells) + " |")
    failures = [
        r for r in runs if not r.ok and any(g.ok for g in runs if g.framework == r.framework)
    ]
    notes = [f"- {r.framework} round {r.round} failed: {r.error}" for r in failures]
    return "\n".join([f"### {mode}", "", *lines, "", *notes]).rstrip() + "\n"


def versions() -> dict[str, dict]:
    """Installed versions of the packages that matter, per environment."""
    script = (
        "import importlib.metadata as m, json\n"
        "names = ['swiftlm', 'ms-swift', 'trl', 'peft', 'transformers', 'torch', 'accelerate']\n"
        "out = {}\n"
        "for n in names:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    pythons = {"swiftlm": SWIFTLM_VENV, "ms-swift": VENVS / "msswift", "trl": VENVS / "trl"}
    found = {}
    for framework, venv in pythons.items():
        python = venv / "bin" / "python"
        if python.exists():
            result = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
            found[framework] = json.loads(result.stdout) if result.returncode == 0 else {}
    return found


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except OSError:
        mem = 0.0
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()}"


def report(args, runs: list[Run], stamp: str, versions_found: dict) -> str:
    flags = " ".join(SWIFTLM_EXTRA_FLAGS) or "(none)"
    version_line = "; ".join(
        f"{fw}: " + ", ".join(f"{k} {v}" for k, v in found.items())
        for fw, found in versions_found.items()
    )
    data = json.loads((ASSETS / "manifest.json").read_text())["data"]
    head = [
        f"Run {stamp} on {machine()}.",
        f"{args.steps} steps x {args.repeats} rounds per framework, dtype {args.dtype}, "
        f"batch {BATCH_SIZE}, max_length {MAX_LENGTH}; swiftlm extra flags: {flags}.",
        f"Data: {data['samples']} samples, mean {data['tokens_mean']} tokens "
        f"(mean {data['label_tokens_mean']} label tokens) per sample.",
        f"Versions: {version_line}.",
        "Medians over rounds; ratios are medians of per-round swiftlm/other ratios "
        "(tokens/s: > 1 means swiftlm is faster; time, RSS: < 1 means swiftlm is lower).",
        "",
    ]
    frameworks = args.frameworks
    tables = [
        mode_table(mode, [r for r in runs if r.mode == mode], frameworks) for mode in args.modes
    ]
    return "\n".join(head) + "\n" + "\n".join(tables)


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--dtype", choices=["bf16", "fp32", "default"], default="bf16")
    parser.add_argument("--skip-setup", action="store_true", help="do not create missing venvs")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    args.frameworks = [f for f in args.frameworks.split(",") if f]
    for mode in args.modes:
        if mode not in LEARNING_RATE:
            parser.error(f"unknown mode {mode!r}; choose from lora, full")
    for framework in args.frameworks:
        if framework not in COMMANDS:
            parser.error(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (tokens/s is measured after the first step)")
    return args


def main() -> None:
    args = parse_args()
    broken = ensure_envs(args.frameworks, args.skip_setup)
    for framework, reason in broken.items():
        print(f"[setup] {framework} cannot run: {reason}", flush=True)
    ensure_assets()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = HERE / "runs" / stamp
    runs = []
    for mode in args.modes:
        for round_ in range(1, args.repeats + 1):
            for framework in args.frameworks:  # alternate: A B C A B C cancels machine drift
                print(f"[{mode} {round_}/{args.repeats}] {framework} ...", flush=True)
                run = run_once(framework, mode, round_, args, root, broken)
                print(f"[{mode} {round_}/{args.repeats}] {framework}: {describe(run)}", flush=True)
                runs.append(run)
    found = versions()
    table = report(args, runs, stamp, found)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    raw = {"stamp": stamp, "args": vars(args), "swiftlm_extra_flags": SWIFTLM_EXTRA_FLAGS,
           "machine": machine(), "versions": found, "runs": [asdict(r) for r in runs]}  # fmt: skip
    (results / f"{stamp}.json").write_text(json.dumps(raw, indent=2) + "\n")
    (results / "latest.md").write_text(table)
    print("\n" + table)
    print(f"raw runs: {results / (stamp + '.json')}; table: {results / 'latest.md'}")


if __name__ == "__main__":
    main()
