"""`swiftlm sft` on a large generated chat JSONL: the main process's peak memory while the data
is encoded for the first time (streamed into the Arrow cache) and trained on for a few steps,
the encoding throughput, and the cached rerun.

    python benchmarks/large_sft_data.py --rows 1000000 --workers 1 2

Rows are deterministic conversations of varied length (one to three turns, a few words to a
few hundred), ~520 bytes a row on average: 1,000,000 rows are ~0.5 GB. The model is the test
suite's tiny Llama with its byte-level BPE tokenizer (tests/conftest.py), so the encoding, not
the model, is what is measured. Each `swiftlm sft` runs in its own process, with its own
empty data cache for a first run; its peak resident memory (VmHWM, which counts the
memory-mapped Arrow pages it touched) is read from /proc while it runs. Times are wall clock
on this machine: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = (  # noqa: SIM905 - a sentence reads better than 44 quoted words
    "the a model data train answer question swiftlm token batch loss cat dog story France "
    "Paris capital helpful assistant quick brown fox jumps over lazy day night light water "
    "number memory stream chunk arrow cache file line row memory fast slow one two three"
).split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def conversation(rng: random.Random, index: int) -> dict:
    """One to three turns; answer lengths spread from a few words to ~200."""
    messages = []
    if index % 10 == 0:
        messages.append({"role": "system", "content": sentence(rng, rng.randint(3, 12))})
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        messages.append({"role": "user", "content": sentence(rng, rng.randint(3, 25))})
        words = int(rng.lognormvariate(3.0, 0.7)) + 2
        messages.append({"role": "assistant", "content": sentence(rng, min(words, 200))})
    return {"messages": messages, "id": index}


def write_rows(path: Path, rows: int, seed: int = 0) -> int:
    """Write `rows` conversations; their size in bytes."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for index in range(rows):
            f.write(json.dumps(conversation(rng, index)) + "\n")
    return path.stat().st_size


def tiny_model(folder: Path) -> Path:
    """The test suite's tiny Llama and ChatML BPE tokenizer (tests/conftest.py)."""
    spec = importlib.util.spec_from_file_location("conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    tokenizer = conftest.build_tokenizer(folder)
    conftest.build_tiny_llama(folder, vocab_size=len(tokenizer))
    return folder


def peak_rss_gb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a running process, in GB."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(match.group(1)) / 1e6 if match else None


def run_sft(model: Path, data: Path, out: Path, cache: Path, workers: int, log: Path) -> dict:
    launcher = "import sys; from swiftlm.cli.main import main; sys.exit(main())"
    argv = [sys.executable, "-c", launcher, "sft", "--model", str(model)]
    argv += ["--dataset", str(data), "--output_dir", str(out), "--max_steps", "2"]
    argv += ["--max_length", "512", "--torch_dtype", "float32", "--report_to", "none"]
    argv += ["--dataset_num_proc", str(workers), "--overwrite_output_dir", "true"]
    env = {**os.environ, "SWIFTLM_DATA_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    started, peak = time.perf_counter(), 0.0
    with log.open("w") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
        while process.poll() is None:
            peak = max(peak, peak_rss_gb(process.pid) or 0.0)
            time.sleep(0.05)
    text = log.read_text()
    if process.returncode != 0:
        raise SystemExit(f"swiftlm sft failed ({process.returncode}):\n{text[-3000:]}")
    return {"seconds": time.perf_counter() - started, "peak_gb": peak, **encoding(text)}


def encoding(text: str) -> dict:
    """The encoding throughput line of a run's log (the first run's, replayed when cached)."""
    match = re.search(
        r"encoded ([\d,]+) samples \(([\d,]+) tokens kept\) in ([\d.]+) s with (\d+) process"
        r"(?:es)?: ([\d,]+) rows/s, ([\d,]+) tokens/s",
        text,
    )
    if not match:
        return {}
    number = [float(g.replace(",", "")) for g in match.groups()]
    keys = ("samples", "tokens", "encode_s", "processes", "rows_per_s", "tokens_per_s")
    return dict(zip(keys, number, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="--dataset_num_proc")
    parser.add_argument("--folder", type=Path, help="keep the files here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        folder = args.folder or Path(temp)
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / f"chat-{args.rows}.jsonl"
        if not data.is_file():
            write_rows(data, args.rows)
        size = data.stat().st_size
        model = tiny_model(folder / "tiny-model")
        print(f"{args.rows:,} rows, {size / 1e6:,.0f} MB: {data}")
        results = []
        for workers in args.workers:
            cache = folder / f"cache-{workers}"
            for name in ("first (uncached)", "rerun (cached)"):
                log = folder / f"sft-{workers}-{name.split()[0]}.log"
                out = folder / f"run-{workers}-{name.split()[0]}"
                result = run_sft(model, data, out, cache, workers, log)
                results.append((f"{name}, {workers} proc", result))
                print(name, workers, json.dumps(result), flush=True)
        print()
        print("| run | wall s | encode s | rows/s | tokens/s | peak RSS of main (GB) |")
        print("|---|---|---|---|---|---|")
        for name, r in results:
            cached = name.startswith("rerun")
            encode = "-" if cached else f"{r.get('encode_s', 0):.0f}"
            rows = "-" if cached else f"{r.get('rows_per_s', 0):,.0f}"
            tokens = "-" if cached else f"{r.get('tokens_per_s', 0):,.0f}"
            print(
                f"| {name} | {r['seconds']:.0f} | {encode} | {rows} | {tokens} | "
                f"{r['peak_gb']:.2f} |"
            )


if __name__ == "__main__":
    main()
