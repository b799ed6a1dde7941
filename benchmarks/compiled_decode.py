"""A compiled decode step for one stream, measured before building it into the engine:
transformers' `generate` with its dynamic cache (eager), with its static cache (eager), and
with the static cache and the forward compiled by inductor, side by side in one run.

    python benchmarks/compiled_decode.py [--new_tokens 64] [--repeats 3] [--torch_dtype bfloat16]

On the packaged default model (SmolLM2-135M-Instruct), greedy, a 100-token prompt. The
compiled run's first call (the compilation) is reported apart; seconds are the median of
`--repeats` calls after it. `same tokens` compares each run's tokens with the eager dynamic
cache's.
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.configuration_utils import CompileConfig

from swiftlm.models.loader import resolve_model


def generate(model, prompt, new_tokens: int, **options) -> tuple[float, list[int]]:
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0, **options,
        )  # fmt: skip
    return time.perf_counter() - start, output[0, prompt.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch_dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=dtype).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(0))  # fmt: skip
    compiled = CompileConfig(mode="default")
    compiled._compile_all_devices = True  # transformers compiles on CUDA only unless told
    runs = {
        "dynamic cache, eager": {},
        "static cache, eager": {"cache_implementation": "static"},
        "static cache, inductor": {"cache_implementation": "static", "compile_config": compiled},
    }
    print(f"SmolLM2-135M-Instruct, {dtype}, one stream, {args.new_tokens} new tokens")
    print("| decode | first call s | median s | tokens/s | ratio | same tokens |")
    print("|---|---|---|---|---|---|")
    baseline_tokens, baseline_seconds = None, None
    for name, options in runs.items():
        first, tokens = generate(model, prompt, args.new_tokens, **options)
        times = [generate(model, prompt, args.new_tokens, **options)[0] for _ in range(args.repeats)]  # fmt: skip
        median = statistics.median(times)
        baseline_tokens = baseline_tokens or tokens
        baseline_seconds = baseline_seconds or median
        same = sum(a == b for a, b in zip(tokens, baseline_tokens, strict=True))
        print(
            f"| {name} | {first:.2f} | {median:.2f} | {args.new_tokens / median:.1f} | "
            f"{baseline_seconds / median:.2f} | {same}/{args.new_tokens} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
