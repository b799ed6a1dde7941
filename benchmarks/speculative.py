"""Prompt-lookup speculative decoding in swiftlm's engine: the same requests with it off and
on, side by side in one run, same model, prompts and machine.

    python benchmarks/speculative.py [--prompts 8] [--tokens 5] [--torch_dtype auto]

On the packaged default model (SmolLM2-135M-Instruct), greedy. The two engines take turns,
request by request, so load from other work on the machine falls on both alike. Workloads:
- chat: questions of the built-in general_qa_eval set, one stream, end of turn respected
  (at most 128 new tokens);
- quote: "repeat this text", the text six answers of the general_qa set (~60 tokens), one
  stream: the kind of request (quoting, editing or summarising its prompt, retrieval,
  code) that prompt lookup is made for;
- serving: the chat questions with 64 new tokens and end-of-turn ignored, as
  `benchmarks/serving.py` generates them, one stream;
- chat x4: the chat workload, four requests at a time.
Reported per workload: tokens/s off and on, their ratio, the acceptance rate (accepted draft
tokens / draft tokens checked), tokens per forward, and whether both wrote the same tokens.
"""

import argparse
import json
import time
from importlib.resources import files

from swiftlm.engine.build import build_engine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.engine.speculation import Speculation
from swiftlm.models.loader import resolve_model


def rows(name: str) -> list[dict]:
    text = files("swiftlm.assets").joinpath(name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def content(row: dict, role: str) -> str:
    return next(m["content"] for m in row["messages"] if m["role"] == role)


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def workloads(tokenizer, count: int) -> dict[str, tuple[list[list[int]], SamplingParams, int]]:
    """name -> (prompts, sampling, requests at a time)."""
    questions = [content(row, "user") for row in rows("general_qa_eval.jsonl")][:count]
    answers = [content(row, "assistant") for row in rows("general_qa.jsonl")]
    passages = [" ".join(answers[i * 6 : i * 6 + 6]) for i in range(count)]  # ~60 tokens
    chat = [chat_ids(tokenizer, q) for q in questions]
    quote = [chat_ids(tokenizer, f"Repeat this text word for word:\n\n{p}") for p in passages]
    answer = SamplingParams(max_tokens=128, temperature=0)
    serving = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    return {
        "chat": (chat, answer, 1),
        "quote": (quote, answer, 1),
        "serving": (chat, serving, 1),
        "chat x4": (chat, answer, 4),
    }


def run(engine, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    results = engine.generate([GenerationRequest(p, params) for p in prompts])
    return time.perf_counter() - start, [r[0].token_ids for r in results]


def compare(engines: dict, prompts, params, width: int) -> dict:
    """Both engines over the same prompts, `width` requests at a time, taking turns."""
    seconds = dict.fromkeys(engines, 0.0)
    outputs: dict[str, list] = {name: [] for name in engines}
    before = engines["on"].stats()
    for start in range(0, len(prompts), width):
        batch = prompts[start : start + width]
        for name, engine in engines.items():
            elapsed, tokens = run(engine, batch, params)
            seconds[name] += elapsed
            outputs[name] += tokens
    after = engines["on"].stats()
    generated = sum(len(t) for t in outputs["on"])
    drafts = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_draft_tokens - before.accepted_draft_tokens
    return {
        "tokens": generated,
        "off": sum(len(t) for t in outputs["off"]) / seconds["off"],
        "on": generated / seconds["on"],
        "acceptance": accepted / drafts if drafts else 0.0,
        "per_forward": generated / max(1, generated - accepted),
        "same": sum(a == b for a, b in zip(outputs["off"], outputs["on"], strict=True)),
        "count": len(prompts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=5, help="draft tokens per step")
    parser.add_argument("--max_ngram", type=int, default=3)
    parser.add_argument("--min_ngram", type=int, default=1)
    parser.add_argument("--torch_dtype", default="auto", help="auto: bf16 where the CPU has it")
    args = parser.parse_args()
    path = resolve_model(None).path
    speculation = Speculation(args.tokens, args.max_ngram, args.min_ngram)
    engines = {
        "off": build_engine(path, max_num_seqs=4, torch_dtype=args.torch_dtype),
        "on": build_engine(
            path, max_num_seqs=4, torch_dtype=args.torch_dtype, speculation=speculation
        ),
    }
    dtype = next(engines["on"].model.parameters()).dtype
    print(f"SmolLM2-135M-Instruct, {dtype}, {args.tokens} draft tokens, n-grams up to "
          f"{args.max_ngram} (at least {args.min_ngram}), {args.prompts} prompts per workload")  # fmt: skip
    print("| workload | tokens | off tok/s | on tok/s | speed-up | acceptance | tokens/forward | same tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    try:
        for name, (prompts, params, width) in workloads(engines["on"].tokenizer, args.prompts).items():  # fmt: skip
            r = compare(engines, prompts, params, width)
            print(
                f"| {name} | {r['tokens']} | {r['off']:.1f} | {r['on']:.1f} | "
                f"{r['on'] / r['off']:.2f}x | {r['acceptance']:.0%} | {r['per_forward']:.2f} | "
                f"{r['same']}/{r['count']} |",
                flush=True,
            )
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
