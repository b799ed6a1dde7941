"""GRPO on the default model with the built-in verifiable task: the held-out accuracy curve.

    .venv/bin/python benchmarks/grpo_arithmetic.py            # train (about 40 min on 2 cores)
    .venv/bin/python benchmarks/grpo_arithmetic.py --run DIR  # report an existing run

1. The base model's held-out accuracy: one greedy answer per prompt of
   swiftlm/arithmetic-heldout (40 additions), scored by the `accuracy` reward, with the same
   engine, token budget and scoring as GRPO's own evaluation.
2. `swiftlm rlhf --rlhf_type grpo` on swiftlm/arithmetic (104 other additions), evaluating
   the held-out prompts every 10 steps (eval_rewards/accuracy).
3. A table of the curve (training reward per 10 steps, held-out accuracy) and an SVG plot,
   docs/grpo_arithmetic.svg.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_COMPLETION = 48
TRAIN = [
    "--rlhf_type", "grpo", "--report_to", "none", "--logging_steps", "1",
    "--per_device_train_batch_size", "16", "--num_generations", "8",
    "--max_completion_length", str(MAX_COMPLETION), "--learning_rate", "1e-4", "--beta", "0.0",
    "--val_dataset", "swiftlm/arithmetic-heldout", "--eval_steps", "10", "--save_steps", "40",
]  # fmt: skip


def base_accuracy() -> float:
    from swiftlm.data.sources import builtin_dataset_path
    from swiftlm.engine.build import build_engine
    from swiftlm.engine.protocol import GenerationRequest, SamplingParams
    from swiftlm.methods.rl.rewards import answers_match
    from swiftlm.models.loader import resolve_model

    rows = [
        json.loads(line)
        for line in builtin_dataset_path("swiftlm/arithmetic-heldout").read_text().splitlines()
    ]
    engine = build_engine(resolve_model(None).path, max_num_seqs=64, warmup=False)
    try:
        requests = [
            GenerationRequest(
                engine.tokenizer.apply_chat_template(
                    row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
                ),
                SamplingParams(max_tokens=MAX_COMPLETION, temperature=0),
            )
            for row in rows
        ]
        results = engine.generate(requests)
    finally:
        engine.shutdown()
    right = [
        answers_match(r[0].text, row["solution"]) for r, row in zip(results, rows, strict=True)
    ]
    return sum(right) / len(right)


def curve(run: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]], float]:
    """(training reward per 10 steps, held-out accuracy per evaluation, elapsed seconds)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward" in r]
    rewards = []
    for start in range(0, len(train), 10):
        window = train[start : start + 10]
        rewards.append((window[-1]["step"], sum(r["reward"] for r in window) / len(window)))
    held_out = [
        (r["step"], r["eval_rewards/accuracy"]) for r in rows if "eval_rewards/accuracy" in r
    ]
    return rewards, held_out, train[-1]["elapsed_s"] if train else 0.0


def svg(rewards, held_out, base: float, path: Path) -> None:
    """A dependency-free line plot: held-out accuracy (with the base at step 0) and the
    training reward, both in [0, 1]."""
    width, height, pad = 640, 320, 40
    last = max([s for s, _ in rewards + held_out] + [1])

    def point(step, value):
        x = pad + (width - 2 * pad) * step / last
        y = height - pad - (height - 2 * pad) * value
        return f"{x:.1f},{y:.1f}"

    def line(points, colour):
        return f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(points)}"/>'

    accuracy = [point(0, base)] + [point(s, v) for s, v in held_out]
    reward = [point(s, v) for s, v in rewards]
    grid = "".join(
        f'<line x1="{pad}" x2="{width - pad}" y1="{height - pad - (height - 2 * pad) * g}" '
        f'y2="{height - pad - (height - 2 * pad) * g}" stroke="#ddd"/>'
        f'<text x="4" y="{height - pad - (height - 2 * pad) * g + 4}" font-size="11">{g:.2f}</text>'
        for g in (0, 0.25, 0.5, 0.75, 1.0)
    )
    ticks = "".join(
        f'<text x="{pad + (width - 2 * pad) * s / last - 6:.1f}" y="{height - pad + 14}" '
        f'font-size="11">{s}</text>'
        for s in range(0, last + 1, max(10, last // 6 // 10 * 10))
    )
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif">{grid}{ticks}{line(accuracy, "#1f77b4")}{line(reward, "#ff7f0e")}'
        f'<text x="{pad}" y="20" font-size="13" fill="#1f77b4">held-out accuracy (greedy)</text>'
        f'<text x="{pad + 220}" y="20" font-size="13" fill="#ff7f0e">training reward (sampled, mean of 10 steps)</text>'
        f'<text x="{width / 2 - 20}" y="{height - 4}" font-size="12">step</text></svg>\n'
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="report this run instead of training one")
    parser.add_argument("--max_steps", type=int, default=120)
    args = parser.parse_args()
    base = base_accuracy()
    print(f"base model held-out accuracy (greedy): {base:.3f}", flush=True)
    run = args.run
    if run is None:
        run = ROOT / "output" / "grpo-arithmetic"
        command = [sys.executable, "-m", "swiftlm.cli.main", "rlhf", *TRAIN,
                   "--max_steps", str(args.max_steps), "--output_dir", str(run),
                   "--overwrite_output_dir", "true"]  # fmt: skip
        subprocess.run(command, check=True)
    rewards, held_out, elapsed = curve(run)
    print("| step | training reward (mean of the last 10 steps) | held-out accuracy |")
    print("|---|---|---|")
    print(f"| 0 | | {base:.3f} |")
    accuracy = dict(held_out)
    for step, reward in rewards:
        print(f"| {step} | {reward:.3f} | {accuracy.get(step, float('nan')):.3f} |")
    print(f"training time: {elapsed / 60:.1f} min")
    svg(rewards, held_out, base, ROOT / "docs" / "grpo_arithmetic.svg")


if __name__ == "__main__":
    main()
