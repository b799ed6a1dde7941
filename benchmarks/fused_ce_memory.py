"""Peak memory and time of the LM-head loss, plain vs fused chunked (swiftlm.losses.chunked_ce).

Forward + backward of the head and cross-entropy alone, on a SmolLM2-135M-sized head (hidden
576, vocab 49152) and 4 x 512 tokens, in float32 and under bf16 autocast. The head weight is
trained (full fine-tuning); `--frozen_head` measures the LoRA case. Variants: `plain` (full
logits), `fused` (the summed loss, gradients made in forward) and `fused_token` (per-token
losses, `linear_cross_entropy_per_token`, whose backward recomputes each chunk's logits),
whose losses are weighted per token before the sum, as a DPO-style or per-sample weighted
loss does.

    python benchmarks/fused_ce_memory.py [--rows 4] [--seq 512] [--repeats 3] [--frozen_head]

Each measurement runs in a fresh subprocess, so that one variant's freed memory cannot hide
the next one's peak, and the variants alternate (plain, fused, plain, fused, ...) so that a
slow patch of a shared machine hits both; the table shows medians. Memory is the peak over a
baseline taken once the inputs exist: on CPU the process's peak RSS (ru_maxrss) minus its RSS
then, on CUDA the allocator's peak (max_memory_allocated) minus what was allocated then. Both
include the head's weight gradient (108 MiB in float32) that any training step holds. Memory
is that of the first forward + backward in the process, time that of a second, warm one.
On CPU, glibc may keep freed blocks of up to 32 MiB in its heap, so peak RSS can vary from
run to run by tens of MiB; `MALLOC_MMAP_THRESHOLD_=1048576` returns them on free, and then the
two fused variants peak alike (measured: 308 / 308 MiB bf16, 176 / 178 MiB bf16 frozen head).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "fused", "fused_token")
DTYPES = ("fp32", "bf16")


# ---- one measurement (runs in its own process) ----------------------------------------------


def make_inputs(args, device):
    import torch

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.seq, args.hidden, generator=generator)
    weight = torch.randn(args.vocab, args.hidden, generator=generator) * args.hidden**-0.5
    labels = torch.randint(0, args.vocab, (args.rows, args.seq), generator=generator)
    hidden = hidden.to(device).requires_grad_()
    weight = weight.to(device).requires_grad_(not args.frozen_head)
    return hidden, weight, labels.to(device)


def loss_fn(variant: str):
    import torch.nn.functional as F

    from swiftlm.losses.causal_lm import shifted_labels, token_cross_entropy_sum
    from swiftlm.losses.chunked_ce import linear_cross_entropy_per_token, linear_cross_entropy_sum

    if variant == "plain":  # what causal_lm_loss does after the model body
        return lambda h, w, labels: token_cross_entropy_sum(F.linear(h, w), labels)
    if variant == "fused_token":
        # Weights of 1 and 1 + 2**-10 alternating: a per-token grad_output, same loss sum
        # to within 0.1%, so the table's sums stay comparable.
        def weighted(h, w, labels):
            losses = linear_cross_entropy_per_token(h, w, shifted_labels(labels))
            weights = 1 + (labels.new_ones(labels.shape).cumsum(-1) % 2) * 2**-10
            return (losses * weights).sum()

        return weighted
    return lambda h, w, labels: linear_cross_entropy_sum(h, w, shifted_labels(labels))


def forward_backward(loss, hidden, weight, labels, dtype: str, device) -> float:
    import torch

    hidden.grad = weight.grad = None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        value = loss(hidden, weight, labels)
    (value / labels.numel()).backward()
    return float(value.detach())


class PeakMemory:
    """Peak bytes above the memory in use when it was created."""

    def __init__(self, device):
        import psutil
        import torch

        self.device, self.torch = device, torch
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            self.baseline = psutil.Process().memory_info().rss
            self.peak_before = self._max_rss()

    @staticmethod
    def _max_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    def peak_increase(self) -> int:
        if self.device.type == "cuda":
            return self.torch.cuda.max_memory_allocated() - self.baseline
        peak = self._max_rss()
        if peak <= self.peak_before:  # an earlier peak (imports) covers this one
            print("warning: the peak was reached before the baseline", file=sys.stderr)
        return peak - self.baseline


def measure(args) -> dict:
    import gc

    import torch

    device = torch.device(args.device)
    loss = loss_fn(args.variant)
    hidden, weight, labels = make_inputs(args, device)
    gc.collect()
    memory = PeakMemory(device)
    value = forward_backward(loss, hidden, weight, labels, args.dtype, device)  # cold
    if device.type == "cuda":
        torch.cuda.synchronize()
    # Read before the timed run: a second step could only add the allocator's caching.
    peak = memory.peak_increase()
    started = time.perf_counter()
    forward_backward(loss, hidden, weight, labels, args.dtype, device)  # warm, timed
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"peak_mib": peak / 2**20, "seconds": seconds, "loss": value}


# ---- the comparison -------------------------------------------------------------------------


def run_worker(args, variant: str, dtype: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--variant", variant, "--dtype", dtype]
    for name in ("rows", "seq", "hidden", "vocab", "device"):
        command += [f"--{name}", str(getattr(args, name))]
    if args.frozen_head:
        command.append("--frozen_head")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{variant} {dtype} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_results(args) -> dict:
    runs = {(v, d): [] for d in args.dtypes for v in VARIANTS}
    for dtype in args.dtypes:
        for repeat in range(args.repeats):
            for variant in VARIANTS:  # alternating: plain, fused, fused_token, plain, ...
                runs[variant, dtype].append(run_worker(args, variant, dtype))
                print(f"  {dtype} {variant} run {repeat + 1}: {runs[variant, dtype][-1]}")
    return {
        key: {field: statistics.median(r[field] for r in rs) for field in rs[0]}
        for key, rs in runs.items()
    }


def print_table(args, results: dict) -> None:
    head = "frozen" if args.frozen_head else "trained"
    print(
        f"\n{args.rows} x {args.seq} tokens, hidden {args.hidden}, vocab {args.vocab}, "
        f"head weight {head}, {args.device}, medians of {args.repeats}\n"
    )
    print("| dtype | variant | peak memory (MiB) | time (s) | loss sum |")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtypes:
        for variant in VARIANTS:
            r = results[variant, dtype]
            print(
                f"| {dtype} | {variant} | {r['peak_mib']:.0f} | {r['seconds']:.2f} "
                f"| {r['loss']:.1f} |"
            )
        plain = results["plain", dtype]
        for variant in VARIANTS[1:]:
            fused = results[variant, dtype]
            print(
                f"| {dtype} | {variant} / plain | {fused['peak_mib'] / plain['peak_mib']:.2f} "
                f"| {fused['seconds'] / plain['seconds']:.2f} | |"
            )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--frozen_head", action="store_true", help="the LoRA case")
    parser.add_argument("--device", default=None, help="cuda if available, else cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print(json.dumps(measure(args)))
        return
    print_table(args, median_results(args))


if __name__ == "__main__":
    main()
