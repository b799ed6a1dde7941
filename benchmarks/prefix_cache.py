"""Prefix caching in swiftlm's engine: the same workloads with the cache off and on, side by
side in one run, same model, prompts and machine.

    python benchmarks/prefix_cache.py [--new_tokens 16] [--requests 16] [--turns 6]

On the packaged default model (SmolLM2-135M-Instruct). Two workloads, each greedy with
end-of-turn ignored, so both engines produce the same tokens (checked):
- shared header: `--requests` chat requests sent together, each a ~1,000-token system prompt
  (question/answer pairs of the built-in general_qa set, as a few-shot or retrieval header)
  and its own question;
- multi-turn chat: one conversation of `--turns` turns, each request resending the history.
Reported: wall time, prompt tokens prefilled by the model and tokens read from the cache
(the engine's own counters, also at /metrics), and the speed-up.
"""

import argparse
import json
import time
from importlib.resources import files

from swiftlm.engine.build import build_engine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.models.loader import resolve_model

HEADER_TOKENS = 1000


def qa_rows(name: str) -> list[dict]:
    text = files("swiftlm.assets").joinpath(name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _pair(row: dict) -> tuple[str, str]:
    messages = row["messages"]
    question = next(m["content"] for m in messages if m["role"] == "user")
    answer = next(m["content"] for m in messages if m["role"] == "assistant")
    return question, answer


def header(tokenizer) -> str:
    """Question/answer pairs until the text is about HEADER_TOKENS tokens long."""
    lines = ["Answer like the examples below.", ""]
    for row in qa_rows("general_qa.jsonl"):
        question, answer = _pair(row)
        lines += [f"Q: {question}", f"A: {answer}", ""]
        if len(tokenizer("\n".join(lines))["input_ids"]) >= HEADER_TOKENS:
            break
    return "\n".join(lines)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def shared_header_prompts(tokenizer, count: int) -> list[list[int]]:
    system = header(tokenizer)
    questions = [_pair(row)[0] for row in qa_rows("general_qa_eval.jsonl")][:count]
    return [
        chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]


def run_shared_header(engine, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    results = engine.generate([GenerationRequest(p, params) for p in prompts])
    return time.perf_counter() - start, [r[0].token_ids for r in results]


def run_chat(engine, tokenizer, turns: int, params) -> tuple[float, list]:
    questions = [_pair(row)[0] for row in qa_rows("general_qa_eval.jsonl")][:turns]
    messages, answers, elapsed = [], [], 0.0
    for question in questions:
        messages.append({"role": "user", "content": question})
        start = time.perf_counter()
        sample = engine.generate([GenerationRequest(chat_ids(tokenizer, messages), params)])[0][0]
        elapsed += time.perf_counter() - start
        answers.append(sample.token_ids)
        messages.append({"role": "assistant", "content": sample.text})
    return elapsed, answers


def measure(cache_mib: int, args) -> dict:
    engine = build_engine(
        resolve_model(None).path,
        max_num_seqs=args.requests,
        torch_dtype=args.torch_dtype,
        prefix_cache_bytes=cache_mib * 2**20,
    )
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    try:
        prompts = shared_header_prompts(engine.tokenizer, args.requests)
        before = engine.stats()
        shared_time, shared_out = run_shared_header(engine, prompts, params)
        middle = engine.stats()
        chat_time, chat_out = run_chat(engine, engine.tokenizer, args.turns, params)
        after = engine.stats()
    finally:
        engine.shutdown()
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "shared": (shared_time, shared_out, _delta(before, middle)),
        "chat": (chat_time, chat_out, _delta(middle, after)),
    }


def _delta(before, after) -> tuple[int, int]:
    return (
        after.prefill_tokens - before.prefill_tokens,
        after.prefix_hit_tokens - before.prefix_hit_tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--cache_mib", type=int, default=256)
    parser.add_argument("--torch_dtype", default="auto", help="auto: bf16 where the CPU has it")
    args = parser.parse_args()
    off, on = measure(0, args), measure(args.cache_mib, args)
    print(f"shared header: {args.requests} requests, {on['prompt_tokens']} prompt tokens")
    print(
        "| workload | cache | seconds | prefilled tokens | from cache | speed-up | same answers |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in ("shared", "chat"):
        (t_off, out_off, (pre_off, _)), (t_on, out_on, (pre_on, hit_on)) = off[name], on[name]
        label = "shared header" if name == "shared" else f"chat, {args.turns} turns"
        print(f"| {label} | off | {t_off:.2f} | {pre_off} | 0 | 1.00x | |")
        same = f"{sum(a == b for a, b in zip(out_on, out_off, strict=True))}/{len(out_off)}"
        print(f"| {label} | on | {t_on:.2f} | {pre_on} | {hit_on} | {t_off / t_on:.2f}x | {same} |")


if __name__ == "__main__":
    main()
