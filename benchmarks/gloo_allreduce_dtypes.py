"""Why `--grad_compression fp16` (or bf16) does not shorten the step on gloo (CPU ranks).

All-reduces the same number of elements in float32, float16 and bfloat16 over 2 gloo ranks of
this machine, and times the cast a compression hook adds. Half the bytes only pay off where
the link, not the CPU, is the bottleneck (a network between nodes, NCCL): on one machine gloo
sums fp16 in software at about the fp32 rate per element, and the cast costs about what the
saved bytes would.

    python benchmarks/gloo_allreduce_dtypes.py            # starts its own 2 ranks
    python benchmarks/gloo_allreduce_dtypes.py --elements 4194304 --port 29949
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUNDS = 7


def median_ms(action) -> float:
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def rank_main(elements: int) -> None:
    dist.init_process_group("gloo")
    source = torch.randn(elements)
    rows = []
    for dtype in DTYPES:
        buffer = source.to(dtype)
        dist.all_reduce(buffer)  # warm-up
        reduce_ms = median_ms(lambda b=buffer: dist.all_reduce(b))
        cast_ms = 0.0 if dtype == torch.float32 else median_ms(lambda d=dtype: source.to(d))
        rows.append((str(dtype).replace("torch.", ""), reduce_ms, cast_ms))
    if dist.get_rank() == 0:
        base = rows[0][1]
        print(f"{elements:,} elements, 2 gloo ranks, median of {ROUNDS}")
        print(f"{'dtype':<9} {'all-reduce ms':>14} {'cast ms':>8} {'total vs fp32':>14}")
        for name, reduce_ms, cast_ms in rows:
            total = (reduce_ms + cast_ms) / base
            print(f"{name:<9} {reduce_ms:>14.2f} {cast_ms:>8.2f} {total:>13.2f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=4 * 2**20)
    parser.add_argument("--port", type=int, default=29949)
    args = parser.parse_args()
    if "RANK" in os.environ:
        rank_main(args.elements)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(args.port), __file__, "--elements", str(args.elements)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    raise SystemExit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
