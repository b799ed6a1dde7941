"""Write swiftlm's built-in preference dataset, `swiftlm/concise-preference`, from the
project's own Q&A set (`assets/general_qa.jsonl`, written for swiftlm).

    python scripts/make_preference_data.py

Each pair prefers the plain, short answer (chosen) over a long one (rejected): the default
model's own greedy answer (SmolLM2-135M-Instruct, at most 160 tokens) where it is at least
twice as long as the plain answer, otherwise the plain answer wrapped in filler (an opening
that praises the question, a closing that offers more help). DPO on it teaches the default
model to answer directly and stop. Every 4th single-turn question is held out
(`assets/concise_heldout.jsonl`, prompts only) to measure the change on questions the run
never saw. Deterministic (greedy decoding): rerunning rewrites the same files.
"""

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "src" / "swiftlm" / "assets"
OPENINGS = [
    "What a great question! I'm so glad you asked, because this is something many people "
    "wonder about.",
    "Thank you for your question. Let me take a moment to think about this carefully and give "
    "you a thorough answer.",
    "That's a really interesting thing to ask about! There is a lot that could be said here, "
    "so let me explain.",
    "Absolutely, I'd be happy to help you with that. This is a topic I find fascinating.",
]
CLOSINGS = [
    "I hope this explanation helps! If you have any more questions about this topic or "
    "anything else, please don't hesitate to ask.",
    "Let me know if you would like me to go into more detail or explain any other related "
    "topics. I'm always here to help!",
    "Feel free to ask me anything else you're curious about. Learning new things is always "
    "exciting, isn't it?",
    "I hope that answers your question. Is there anything else you would like to know? I'd "
    "be glad to help further.",
]


def main() -> None:
    rows = [json.loads(line) for line in (ASSETS / "general_qa.jsonl").read_text().splitlines()]
    single = [r["messages"] for r in rows if len(r["messages"]) == 2]
    heldout = [{"messages": [q]} for i, (q, _) in enumerate(single) if i % 4 == 3]
    train = [(i, q, a) for i, (q, a) in enumerate(single) if i % 4 != 3]
    own = default_model_answers([q for _, q, _ in train])
    pairs, from_model = [], 0
    for (i, question, answer), long in zip(train, own, strict=True):
        if len(long) >= 2 * len(answer["content"]) and long.strip() != answer["content"]:
            rejected, from_model = long, from_model + 1
        else:
            rejected = f"{OPENINGS[i % 4]} {answer['content']} {CLOSINGS[(i // 4) % 4]}"
        pairs.append({"messages": [question, answer], "rejected_response": rejected})
    write(ASSETS / "concise_preference.jsonl", pairs)
    write(ASSETS / "concise_heldout.jsonl", heldout)
    print(f"{len(pairs)} pairs ({from_model} rejected answers from the model), "
          f"{len(heldout)} held-out prompts")  # fmt: skip


def default_model_answers(questions: list[dict]) -> list[str]:
    from swiftlm.engine.build import build_engine
    from swiftlm.engine.protocol import GenerationRequest, SamplingParams
    from swiftlm.models.loader import resolve_model

    engine = build_engine(resolve_model(None).path)
    tokenizer, params = engine.tokenizer, SamplingParams(max_tokens=160, temperature=0)
    prompts = [
        tokenizer.apply_chat_template([q], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    results = engine.generate([GenerationRequest(p, params) for p in ids])
    engine.shutdown()
    return [tokenizer.decode(r[0].token_ids, skip_special_tokens=True).strip() for r in results]


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


if __name__ == "__main__":
    main()
