"""Attention over a packed row (padding-free SFT's layout), three ways, side by side in one run:

    python benchmarks/packed_attention.py [--dtype bfloat16|float32] [--samples 4 8] [--repeats 5]

1. `per_sequence`: SDPA (causal) on each sample's slice of the row, concatenated: what
   swiftlm's `swiftlm_varlen` attention does on a CPU (models/attention.py);
2. `block_mask`: one SDPA call over the whole row with a block-diagonal causal boolean mask
   [T, T] (what transformers' sdpa path builds from packed position ids);
3. `flex`: `torch.nn.attention.flex_attention` with a document-causal `BlockMask`, compiled
   by inductor (its first call, the compilation, is reported apart). torch 2.13 has no flex
   backward on a CPU: the row then says so.

Forward and backward of one attention layer of the framework benchmark's 110M Llama (12
heads of 64), rows of `--samples` samples with the benchmark data's lengths (57-512 tokens,
mean ~300, seeded). Each variant's output and input gradients are compared with
per_sequence's (max abs difference). Times: the median of `--repeats` calls after a warm-up.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, HEAD_DIM = 12, 64


def sample_lengths(count: int, seed: int) -> list[int]:
    """Sample lengths like the framework benchmark's chat data: 57-512 tokens, mean ~300."""
    generator = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(57, 513, (count,), generator=generator)]


def per_sequence(q, k, v, bounds):
    pieces = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
        for s, e in bounds
    ]
    return torch.cat(pieces, dim=2)


def block_mask_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def document_ids(bounds, length: int) -> torch.Tensor:
    ids = torch.empty(length, dtype=torch.long)
    for index, (s, e) in enumerate(bounds):
        ids[s:e] = index
    return ids


def timed(fn, q, k, v, repeats: int) -> tuple[float, float, tuple]:
    """(first call s, median s of forward + backward, (output, grads)) of `fn(q, k, v)`."""

    def once():
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        out = fn(q, k, v)
        out.float().sum().backward()
        return time.perf_counter() - start, out

    first, out = once()
    times = [once()[0] for _ in range(repeats)]
    return first, statistics.median(times), (out.detach(), q.grad, k.grad, v.grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled_flex = torch.compile(flex_attention, dynamic=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(
        "| samples | tokens | variant | first call (s) | fwd+bwd (ms) | x per_sequence | max diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for count in args.samples:
        measure_row(count, dtype, args.repeats, compiled_flex, create_block_mask)


def measure_row(count: int, dtype, repeats: int, compiled_flex, create_block_mask) -> None:
    """Time the three variants on one packed row of `count` samples; print their rows."""
    lengths = sample_lengths(count, seed=count)
    starts = [sum(lengths[:i]) for i in range(count)]
    bounds = [(s, s + n) for s, n in zip(starts, lengths, strict=True)]
    total = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, HEADS, total, HEAD_DIM, generator=generator).to(dtype).requires_grad_()
        for _ in range(3)
    )
    docs = document_ids(bounds, total)
    positions = torch.arange(total)
    mask = (docs[:, None] == docs[None, :]) & (positions[:, None] >= positions[None, :])

    def causal_document(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    block = create_block_mask(causal_document, 1, 1, total, total, device="cpu")
    variants = {
        "per_sequence": lambda q, k, v: per_sequence(q, k, v, bounds),
        "block_mask": lambda q, k, v: block_mask_attention(q, k, v, mask[None, None]),
        "flex": lambda q, k, v: compiled_flex(q, k, v, block_mask=block),
    }
    reference, base = None, None
    for name, fn in variants.items():
        try:
            first, median, results = timed(fn, q, k, v, repeats)
        except NotImplementedError as exc:  # flex has no backward on a CPU (torch 2.13)
            print(f"| {count} | {total} | {name} | not run: {exc} | | | |", flush=True)
            continue
        if reference is None:
            reference, base = results, median
        pairs = zip(results, reference, strict=True)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        print(f"| {count} | {total} | {name} | {first:.2f} | {median * 1000:.1f} | "
              f"{base / median:.2f}x | {diff:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
