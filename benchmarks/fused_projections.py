"""Fused QKV and gate/up projections against separate ones, for one decode step's projections
of the default model's shapes (SmolLM2-135M-Instruct: every layer's q, k, v, gate and up
products), at 1, 4 and 16 rows, in one run:

    python benchmarks/fused_projections.py [--dtype bfloat16|float32] [--repeats 5]

Measured before fusing the weights at load time in swiftlm's engine (what vLLM and llama.cpp
do). Each variant runs 20 steps per repeat, taking turns; the best repeat is reported (the
machine is shared). The fused products compute the same numbers (checked here to the dtype's
rounding), so only the time differs.
"""

import argparse
import time

import torch
from transformers import AutoConfig

from swiftlm.models.loader import resolve_model

STEPS = 20


def projections(config, dtype, fused: bool, generator) -> list[list[torch.Tensor]]:
    """Per layer, the projection weights ([out, in]) a decode step multiplies by."""
    h, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(h + 2 * kv, h), (2 * inter, h)] if fused else [(h, h), (kv, h), (kv, h)]
    if not fused:
        shapes += [(inter, h), (inter, h)]
    return [
        [torch.randn(shape, generator=generator).to(dtype) * 0.02 for shape in shapes]
        for _ in range(config.num_hidden_layers)
    ]


@torch.inference_mode()
def step(layers, x) -> None:
    for weights in layers:
        for weight in weights:
            torch.nn.functional.linear(x, weight)


def best_ms(layers, x, repeats: int, other, other_x) -> tuple[float, float]:
    times = ([], [])
    for _ in range(repeats):
        for index, (ls, xs) in enumerate(((layers, x), (other, other_x))):
            start = time.perf_counter()
            for _ in range(STEPS):
                step(ls, xs)
            times[index].append((time.perf_counter() - start) / STEPS * 1000)
    return min(times[0]), min(times[1])


def check_same_numbers(config, dtype) -> float:
    """Largest difference between the fused QKV product and the three separate ones."""
    g = torch.Generator().manual_seed(0)
    separate = projections(config, dtype, False, g)[0][:3]
    fused = torch.cat(separate)
    x = torch.randn(4, config.hidden_size, generator=g).to(dtype)
    together = torch.nn.functional.linear(x, fused)
    apart = torch.cat([torch.nn.functional.linear(x, w) for w in separate], dim=-1)
    return (together.float() - apart.float()).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(resolve_model(None).path)
    g = torch.Generator().manual_seed(0)
    separate, fused = projections(config, dtype, False, g), projections(config, dtype, True, g)
    print(f"{args.dtype}, {config.num_hidden_layers} layers, hidden {config.hidden_size}")
    print(f"fused QKV equals the separate products within {check_same_numbers(config, dtype):.1e}")
    print("| rows | separate ms/step | fused ms/step | fused speed-up |")
    print("|---|---|---|---|")
    for rows in (1, 4, 16):
        x = torch.randn(rows, 1, config.hidden_size, generator=g).to(dtype)
        step(separate, x), step(fused, x)  # the first products of a shape
        apart, together = best_ms(separate, x, args.repeats, fused, x)
        print(f"| {rows} | {apart:.2f} | {together:.2f} | {apart / together:.2f}x |")


if __name__ == "__main__":
    main()
