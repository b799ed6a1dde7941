"""The measured probe of this machine's CPUs, for `--devices Nxcpu`: run once, cached.

CPUs differ too much for a table, so the planner measures what it needs, each in a fresh
process so one measurement does not disturb the next:

- the matmul FLOP/s of one worker (torchrun gives each of several workers one thread) in
  the compute dtype and in float32;
- the memory bandwidth (an in-place add over 256 MiB tensors: the optimizer's access pattern);
- gloo's all-reduce, reduce-scatter and all-gather bus bandwidths (64 MiB) and latency
  (4 KiB) between N processes;
- the runtime baseline: the peak RSS of a worker that has imported what `swiftlm sft` imports
  and joined a process group, before any model exists (and the same with DeepSpeed imported).

`python -m swiftlm.plan.probe N` prints the measurements as JSON.
"""

import json
import os
import resource
import subprocess
import sys
import time

from swiftlm.models.loader import cache_root, cpu_has_fast_bf16
from swiftlm.plan.devices import GB, DeviceSpec

PROBE_FILE = "plan_probe.json"
PROBE_VERSION = 4  # bump when a measurement changes: cached probes are then taken again
ALLREDUCE_BYTES = 64 * 2**20


def cpu_device(count: int) -> DeviceSpec:
    """One of `count` worker processes on this machine, from the cached probe."""
    import psutil

    probe = cached_probe(count)
    return DeviceSpec(
        name=f"CPU process ({probe['cpu']}, {probe['threads']} thread(s))",
        kind="cpu",
        flops=probe["matmul_flops"],
        fp32_flops=probe["matmul_flops_fp32"],
        memory_bytes=psutil.virtual_memory().total / count,
        memory_bandwidth=probe["memory_bandwidth"],
        intra_link="gloo (shared memory / loopback)",
        intra_bandwidth=probe["allreduce_bandwidth"] or 1 * GB,
        reduce_scatter_bandwidth=probe["reduce_scatter_bandwidth"] or None,
        allgather_bandwidth=probe["allgather_bandwidth"] or None,
        collective_latency=probe["collective_latency"],
        inter_link="gloo over Ethernet (assumed 10 Gb/s)",
        inter_bandwidth=1.25 * GB,
        baseline_bytes=probe["baseline_bytes"],
        baseline_deepspeed_bytes=probe["baseline_bytes_deepspeed"],
    )


def cached_probe(count: int) -> dict:
    """The probe's measurements for `count` workers, measured on first use."""
    cache = cache_root() / PROBE_FILE
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    key = f"v{PROBE_VERSION}|{_cpu_name()}|workers={count}|cores={os.cpu_count()}"
    if key not in known:
        print(f"Probing this machine's CPUs for {count} worker(s) (once) ...", flush=True)
        out = subprocess.run(
            [sys.executable, "-m", "swiftlm.plan.probe", str(count)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": str(_threads(count))},
        )
        known[key] = json.loads(out.stdout.strip().splitlines()[-1])
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    return known[key]


def _threads(count: int) -> int:
    """Threads per worker: torchrun sets OMP_NUM_THREADS=1 for several workers per node."""
    return 1 if count > 1 else (os.cpu_count() or 1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "cpu"
    return next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "cpu")


def measure(count: int) -> dict:
    import torch

    from swiftlm.monitor.mfu import measure_peak

    torch.set_num_threads(_threads(count))
    dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    cpu = torch.device("cpu")
    return {
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "matmul_flops": max(measure_peak(cpu, dtype) for _ in range(3)),
        "matmul_flops_fp32": max(measure_peak(cpu, torch.float32) for _ in range(3)),
        "memory_bandwidth": _memory_bandwidth(),
        **_link(count),
        "baseline_bytes": _baseline_rss(deepspeed=False),
        "baseline_bytes_deepspeed": _baseline_rss(deepspeed=True),
    }


def _link(count: int) -> dict:
    if count == 1:
        return {
            "allreduce_bandwidth": 0.0,
            "reduce_scatter_bandwidth": 0.0,
            "allgather_bandwidth": 0.0,
            "collective_latency": 0.0,
        }
    return _collectives(count)


def _memory_bandwidth() -> float:
    import torch

    a, b = torch.ones(2**26), torch.ones(2**26)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - start)
    return 3 * a.numel() * 4 / best  # read a and b, write a


# Each collective on a 64 MiB float32 buffer, best of 5, in a process group of N ranks.
COLLECTIVES_CODE = """
import time, torch, torch.distributed as dist
dist.init_process_group('gloo')
n, rank = dist.get_world_size(), dist.get_rank()
full, part = torch.ones(%d), None
part = torch.ones(full.numel() // n)
def best(op):
    op(); b = 1e9
    for _ in range(5):
        dist.barrier(); t = time.perf_counter(); op()
        b = min(b, time.perf_counter() - t)
    return b
out = torch.empty_like(full)
times = [
    best(lambda: dist.all_reduce(full)),
    best(lambda: dist.reduce_scatter_tensor(part, full)),
    best(lambda: dist.all_gather_into_tensor(out, part)),
    best(lambda: dist.all_reduce(torch.ones(1024))),
]
if rank == 0: print(*times)
dist.destroy_process_group()
"""


def _collectives(count: int) -> dict:
    """Bus bandwidths (bytes/s per rank, ring convention: an all-reduce moves 2(n-1)/n of
    the buffer per rank, a reduce-scatter or all-gather (n-1)/n) of gloo's all-reduce,
    reduce-scatter and all-gather on 64 MiB, and the latency of a 4 KiB all-reduce. Gloo's
    reduce-scatter and all-gather reach well under its all-reduce's bandwidth (measured here:
    0.3x and 0.4x), which is why FSDP2 and ZeRO-3 cost more on CPUs than bytes alone say."""
    port = _free_port()
    procs = []
    for rank in range(count):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(RANK=str(rank), WORLD_SIZE=str(count), OMP_NUM_THREADS="1")
        code = COLLECTIVES_CODE % (ALLREDUCE_BYTES // 4)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-W", "ignore", "-c", code],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    all_reduce, scatter, gather, small = map(
        float, procs[0].communicate()[0].strip().splitlines()[-1].split()
    )
    for proc in procs[1:]:
        proc.wait()
    ring = (count - 1) / count
    return {
        "allreduce_bandwidth": 2 * ring * ALLREDUCE_BYTES / all_reduce,
        "reduce_scatter_bandwidth": ring * ALLREDUCE_BYTES / scatter,
        "allgather_bandwidth": ring * ALLREDUCE_BYTES / gather,
        "collective_latency": small,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _baseline_rss(deepspeed: bool) -> float:
    """Resident memory (bytes) of a fresh process that imported a training worker's modules
    and joined a one-process gloo group: what every rank holds before its model. (Resident,
    not the import's high-water mark: the training peak stacks on what stays.)"""
    code = (
        "import torch, torch.distributed as dist\n"
        "import swiftlm.train.run, swiftlm.train.loop, swiftlm.distributed.spmd\n"
        "import transformers, peft, datasets\n"
        "from transformers import LlamaForCausalLM\n"
        + ("import deepspeed\n" if deepspeed else "")
        + "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=0, "
        "world_size=1)\n"
        "import gc; gc.collect()\n"
        "status = open('/proc/self/status').read()\n"
        "print(int(status.split('VmRSS:')[1].split()[0]) * 1024)\n"
    ) % _free_port()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))), flush=True)
    # this process's own peak, for whoever debugs the probe
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
