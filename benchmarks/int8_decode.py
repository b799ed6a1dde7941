"""One decoding stream in bf16 against torchao's int8 weight-only weights, same engine, model
and prompt, in one run:

    python benchmarks/int8_decode.py [--new_tokens 64]

On the packaged default model (SmolLM2-135M-Instruct). Prints tokens/s of each and how many
greedy tokens agree. torchao's `Int8WeightOnlyConfig` runs eagerly here (no torch.compile).
"""

import argparse
import time

from swiftlm.engine.build import build_engine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.models.loader import resolve_model


def stream_speed(engine, params) -> tuple[float, list[int]]:
    prompt = engine.tokenizer("Tell me about the ocean and its creatures.")["input_ids"]
    engine.generate([GenerationRequest(prompt, params)])  # the first forwards of a shape
    start = time.perf_counter()
    sample = engine.generate([GenerationRequest(prompt, params)])[0][0]
    return params.max_tokens / (time.perf_counter() - start), sample.token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    engine = build_engine(resolve_model(None).path, max_num_seqs=4)
    try:
        bf16_speed, bf16_tokens = stream_speed(engine, params)
        quantize_(engine.model, Int8WeightOnlyConfig())
        int8_speed, int8_tokens = stream_speed(engine, params)
    finally:
        engine.shutdown()
    same = sum(a == b for a, b in zip(bf16_tokens, int8_tokens, strict=True))
    print("| weights | tokens/s | ratio | greedy tokens equal to bf16 |")
    print("|---|---|---|---|")
    print(f"| bf16 | {bf16_speed:.1f} | 1.00 | |")
    print(
        f"| int8 weight-only | {int8_speed:.1f} | {int8_speed / bf16_speed:.2f} | {same}/{len(bf16_tokens)} |"
    )


if __name__ == "__main__":
    main()
