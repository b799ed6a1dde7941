"""Training throughput of a mixture-of-experts model by experts implementation, through
`swiftlm pt` as a user runs it, side by side in one run.

    python benchmarks/moe.py [--repeats 2] [--steps 6] [--dtypes float32 bfloat16]

The model: a seeded Qwen3-MoE built in-process (6 layers, hidden 512, 32 experts of width
256, top 4, SmolLM2's 49,152-token vocabulary: ~105M parameters, ~35M used per token) with
the packaged SmolLM2 tokenizer. Full fine-tuning (`swiftlm pt --train_type full`) on 4 rows
of 512 tokens per step (the packaged held-out text, repeated), each variant in its own
process, in turns, `--repeats` rounds; the figure is the last logged window's tokens/s
(steps 2 on: the first step's warm-up is left out), best round per variant.

Variants (`--experts_impl`): `grouped_mm`, swiftlm's default (transformers' grouped GEMM:
tokens sorted by expert, `torch._grouped_mm`), and `eager`, the modeling file's Python loop
over experts with one-hot masks (what transformers 4.x ran). `batched_mm` is not run: it
gathers every token's expert weights, 2,048 x 4 x 1.5 MB here, and does not fit in memory.
The first logged losses of the variants are compared: the implementations compute the same
function, so they agree to the dtype's rounding. Then one MoE layer's experts alone (forward
and backward of 2,048 tokens, in this process): the gain before the rest of a step dilutes it.
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HIDDEN, EXPERTS, TOP_K, LAYERS = 512, 32, 4, 6


def build_model(folder: Path) -> Path:
    """The seeded MoE with the packaged SmolLM2 tokenizer, saved once."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from swiftlm.models.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        moe_intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    print(f"model: {total / 1e6:.1f}M parameters, saved to {folder}")
    return folder


def write_corpus(path: Path) -> Path:
    text = (Path(__file__).parents[1] / "src/swiftlm/assets/heldout.txt").read_text()
    rows = [{"text": " ".join([text] * 4)} for _ in range(64)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_variant(model: Path, corpus: Path, out: Path, impl: str, dtype: str, steps: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    argv = [
        sys.executable, "-m", "swiftlm", "pt", "--model", str(model), "--dataset", str(corpus),
        "--output_dir", str(out), "--train_type", "full", "--experts_impl", impl,
        "--torch_dtype", dtype, "--max_length", "512", "--per_device_train_batch_size", "4",
        "--max_steps", str(steps), "--logging_steps", str(steps - 1), "--report_to", "none",
        "--save_steps", str(steps * 10), "--learning_rate", "1e-5", "--split_dataset_ratio", "0",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{impl} {dtype} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "tokens_per_second" in row]
    return {"tokens_per_second": train[-1]["tokens_per_second"], "first_loss": train[0]["loss"]}


def block_times(dtype: torch.dtype, tokens: int = 2048, rounds: int = 4) -> dict[str, float]:
    """Forward + backward of one MoE layer's experts (this model's shape) alone, per
    implementation: the best of `rounds`, in ms."""
    import time

    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=256, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to(dtype)
    for weight in block.parameters():
        torch.nn.init.normal_(weight, std=0.02)
    hidden = torch.randn(1, tokens, HIDDEN, dtype=dtype)
    best = {}
    for impl in ("grouped_mm", "eager") * rounds:
        config._experts_implementation = impl
        x = hidden.clone().requires_grad_()
        start = time.perf_counter()
        block(x).square().sum().backward()
        elapsed = (time.perf_counter() - start) * 1e3
        best[impl] = min(best.get(impl, elapsed), elapsed)
        block.zero_grad()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/swiftlm-moe-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work / "model")
    corpus = write_corpus(args.work / "corpus.jsonl")
    variants = [(impl, dtype) for dtype in args.dtypes for impl in ("grouped_mm", "eager")]
    best: dict[tuple[str, str], dict] = {}
    for round_ in range(args.repeats):
        for impl, dtype in variants:
            result = run_variant(model, corpus, args.work / "run", impl, dtype, args.steps)
            print(
                f"round {round_ + 1}: {impl:10s} {dtype:9s} {result['tokens_per_second']:8.1f} tok/s"
            )
            kept = best.get((impl, dtype))
            if kept is None or result["tokens_per_second"] > kept["tokens_per_second"]:
                best[(impl, dtype)] = result
    print("\n| dtype | experts alone, grouped_mm ms | eager ms | ratio |")
    print("|---|---|---|---|")
    for dtype in args.dtypes:
        ms = block_times(getattr(torch, dtype))
        print(f"| {dtype} | {ms['grouped_mm']:.1f} | {ms['eager']:.1f} | "
              f"{ms['eager'] / ms['grouped_mm']:.2f}x |")  # fmt: skip
    print("\n| dtype | --experts_impl | tokens/s | vs eager | first loss |")
    print("|---|---|---|---|---|")
    for impl, dtype in variants:
        result, eager = best[(impl, dtype)], best[("eager", dtype)]
        ratio = result["tokens_per_second"] / eager["tokens_per_second"]
        print(
            f"| {dtype} | {impl} | {result['tokens_per_second']:.1f} | {ratio:.2f}x | "
            f"{result['first_loss']:.6f} |"
        )


if __name__ == "__main__":
    main()
