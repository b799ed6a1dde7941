"""Batch inference: static batches (HF `generate`, the previous `swiftlm infer`) vs the
continuous-batching engine, side by side in one run, same model and prompts.

    python benchmarks/infer_batch.py [--prompts 32] [--new_tokens 64] [--static_batch 8]
                                     [--transformers_cb]

On the packaged default model (SmolLM2-135M-Instruct, bf16 on CPUs with fast bf16). Every
answer runs the full `--new_tokens` (end-of-turn ignored) so both sides produce the same
number of tokens. Static batching keeps a batch running until its longest answer ends and
pads prompts of one batch to the longest; the engine decodes up to 32 sequences per step.
`--transformers_cb` adds transformers' own continuous batching (`model.generate_batch`, paged
attention), run last because it switches the model's attention implementation.
"""

import argparse
import time

import torch

from swiftlm.engine.build import build_engine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.models.loader import resolve_model

TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "rivers", "deserts", "owls", "glaciers"]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        question = f"Tell me {i % 5 + 1} facts about {TOPICS[i % len(TOPICS)]}." + " Why?" * (i % 7)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def static_batches(model, tokenizer, prompts, new_tokens: int, batch: int) -> int:
    """The previous infer: left-padded batches of `batch` prompts through `model.generate`."""
    tokenizer.padding_side = "left"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # as infer grouped them
    produced = 0
    for begin in range(0, len(order), batch):
        rows = [{"input_ids": prompts[i]} for i in order[begin : begin + batch]]
        inputs = tokenizer.pad(rows, return_tensors="pt")
        with torch.inference_mode():
            output = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        produced += (output.shape[1] - inputs["input_ids"].shape[1]) * len(rows)
    return produced


def continuous(engine, prompts, new_tokens: int) -> int:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest(p, params) for p in prompts])
    return sum(len(samples[0].token_ids) for samples in results)


def transformers_cb(model, tokenizer, prompts, new_tokens: int) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return sum(len(output.generated_tokens) for output in outputs.values())


def timed(run) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = run()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--static_batch", type=int, default=8)
    parser.add_argument("--max_num_seqs", type=int, default=32)
    parser.add_argument("--transformers_cb", action="store_true")
    args = parser.parse_args()

    engine = build_engine(resolve_model(None).path, max_num_seqs=args.max_num_seqs)
    model, tokenizer = engine.model, engine.tokenizer
    prompts = chat_prompts(tokenizer, args.prompts)
    print(f"{len(prompts)} prompts x {args.new_tokens} new tokens, {model.dtype}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    continuous(engine, prompts[:2], 4)  # warm up both paths once
    static_batches(model, tokenizer, prompts[:2], 4, 2)
    rows = {
        f"static batches of {args.static_batch} (HF generate)": timed(
            lambda: static_batches(model, tokenizer, prompts, args.new_tokens, args.static_batch)
        ),
        f"continuous batching (max_num_seqs {args.max_num_seqs})": timed(
            lambda: continuous(engine, prompts, args.new_tokens)
        ),
    }
    engine.shutdown()
    if args.transformers_cb:
        transformers_cb(model, tokenizer, prompts[:2], 4)
        rows["transformers continuous batching (generate_batch)"] = timed(
            lambda: transformers_cb(model, tokenizer, prompts, args.new_tokens)
        )
    print("| method | tokens | seconds | tokens/s |\n|---|---|---|---|")
    speeds = []
    for name, (tokens, seconds) in rows.items():
        speeds.append(tokens / seconds)
        print(f"| {name} | {tokens} | {seconds:.1f} | {speeds[-1]:.1f} |")
    print(f"swiftlm continuous / static: {speeds[1] / speeds[0]:.2f}x")


if __name__ == "__main__":
    main()
