"""FP8 training's loss curve against bf16's over 100 steps, side by side in one run.

    python benchmarks/fp8_loss.py [--steps 100]

The model: a seeded Llama built in-process (4 layers, hidden 256, MLP 1,024, SmolLM2's
tokenizer and 49,152-token vocabulary, tied embeddings: ~14M parameters) trained in full by
`swiftlm sft` on the built-in self-cognition and Q&A data (`--torch_dtype bfloat16`, learning
rate 1e-3, 8 samples per step, the same seed and batches), once as is and once per
`--fp8_recipe` (torchao float8; emulated on a CPU: the float8 casts and scales of a GPU run,
the products in high precision). Each curve is compared with bf16's step by step: the largest
difference, and the means of the first and last 10 steps.

The band this is held to: float8 e4m3 rounds each product's inputs to 3 mantissa bits
(unit roundoff 2^-4 = 6%), bf16 to 7 (2^-8); the loss of one step moves by a small part of
that, and training follows the same path as long as the rounding only adds noise. The goal:
the last 10 steps' mean loss within 5% of bf16's, every step within 10%.
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from seeded_llama import save_seeded_llama  # noqa: E402


def build_model(folder: Path) -> Path:
    return save_seeded_llama(
        folder, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip


def losses(model: Path, out: Path, steps: int, recipe: str | None) -> list[float]:
    shutil.rmtree(out, ignore_errors=True)
    argv = [
        sys.executable, "-m", "swiftlm", "sft", "--model", str(model), "--output_dir", str(out),
        "--dataset", "swiftlm/self-cognition", "swiftlm/general-qa",
        "--train_type", "full", "--torch_dtype", "bfloat16", "--max_steps", str(steps),
        "--learning_rate", "1e-3", "--per_device_train_batch_size", "8", "--logging_steps", "1",
        "--save_steps", str(steps * 10), "--report_to", "none", "--seed", "3",
    ]  # fmt: skip
    if recipe:
        argv += ["--fp8_recipe", recipe]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{recipe or 'bf16'} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "tokens_per_second" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--work", type=Path, default=Path("/tmp/swiftlm-fp8-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work / "model")
    curves = {
        name: losses(model, args.work / name, args.steps, recipe)
        for name, recipe in (
            ("bf16", None),
            ("fp8 tensorwise", "tensorwise"),
            ("fp8 rowwise", "rowwise"),
        )
    }
    base = curves["bf16"]
    print("| run | first 10 steps | last 10 steps | last 10 vs bf16 | largest step difference |")
    print("|---|---|---|---|---|")
    for name, curve in curves.items():
        first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
        worst = max(abs(a - b) / b for a, b in zip(curve, base, strict=True))
        print(
            f"| {name} | {first:.4f} | {last:.4f} | {last / (sum(base[-10:]) / 10) - 1:+.2%} | "
            f"{worst:.2%} |"
        )
    (args.work / "curves.json").write_text(json.dumps(curves))


if __name__ == "__main__":
    main()
