"""The engine's decode throughput by how its linear weights are held: as loaded
(`--packed_weights false`), packed for oneDNN (`engine/packed_weights.py`, what
`--packed_weights auto` does), and packed with each layer's sibling projections joined into
one product (q/k/v and gate/up: measured here, not built into the engine), side by side in one
run.

    python benchmarks/engine_weights.py [--repeats 2] [--new_tokens 64]

On the packaged default model (SmolLM2-135M-Instruct) in bf16, greedy, end-of-turn ignored,
the chat prompts of `infer_batch.py`: one stream answering 8 prompts one after another, and
16 streams (16 threads, each sending its next prompt when its answer is done) answering 64.
One engine at a time, in turns, `--repeats` rounds; the best round per variant is reported
(the machine is shared). No HTTP server: this is the engine's own rate (`serving.py` measures
`deploy`). `same tokens` compares each variant's one-stream answers with the loaded weights'
(one request at a time: with 16 streams which rows share a batch depends on timing, and a
near-tied greedy pick can then go either way, in any variant).
"""

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from infer_batch import chat_prompts  # noqa: E402
from torch import nn  # noqa: E402

from swiftlm.engine.build import build_engine  # noqa: E402
from swiftlm.engine.packed_weights import (  # noqa: E402
    PackedLinear,
    one_thread,
    pack_linear_weights,
)
from swiftlm.engine.protocol import GenerationRequest, SamplingParams  # noqa: E402
from swiftlm.models.loader import resolve_model  # noqa: E402

STREAMS = 16
SIBLINGS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


class JointProduct:
    """One packed product over the joined weights of sibling linears of one input. The model's
    forward still calls each sibling: the first call with an input runs the product and keeps
    its parts until every sibling has read its own; a call with another input runs it anew."""

    def __init__(self, linears: list[nn.Linear]):
        weight = torch.cat([linear.weight.detach() for linear in linears])
        joined = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        joined.weight = nn.Parameter(weight, requires_grad=False)
        self.linear = PackedLinear(joined)
        self.sizes = [linear.out_features for linear in linears]
        self.kept = None  # (input, its parts, the indices not yet read)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        kept = self.kept
        if kept is None or kept[0] is not x or index not in kept[2]:
            kept = (x, self.linear(x).split(self.sizes, dim=-1), set(range(len(self.sizes))))
            self.kept = kept
        kept[2].discard(index)
        if not kept[2]:
            self.kept = None
        return kept[1][index]


class ProjectionPart(nn.Module):
    def __init__(self, joint: JointProduct, index: int):
        super().__init__()
        self.joint, self.index = joint, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.joint.part(x, self.index)


def joined_and_packed(model) -> None:
    """Join each layer's q/k/v and gate/up (the default model is a Llama), then pack the rest.
    On one thread, as packing does (`packed_weights.one_thread` says why)."""
    with one_thread():
        for layer in model.model.layers:
            for module_name, names in SIBLINGS.items():
                module = getattr(layer, module_name)
                joint = JointProduct([getattr(module, name) for name in names])
                for index, name in enumerate(names):
                    setattr(module, name, ProjectionPart(joint, index))
    pack_linear_weights(model)


VARIANTS = {
    "as loaded (`--packed_weights false`)": lambda model: None,
    "packed (`--packed_weights auto`)": pack_linear_weights,
    "packed, sibling projections joined": joined_and_packed,
}


def one_stream(engine, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    answers = [engine.generate([GenerationRequest(p, params)])[0][0].token_ids for p in prompts]
    return sum(map(len, answers)) / (time.perf_counter() - start), answers


def many_streams(engine, prompts, params) -> float:
    answers: list[list[int]] = [[] for _ in prompts]

    def client(first: int) -> None:
        for i in range(first, len(prompts), STREAMS):
            answers[i] = engine.generate([GenerationRequest(prompts[i], params)])[0][0].token_ids

    threads = [threading.Thread(target=client, args=(c,)) for c in range(STREAMS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(map(len, answers)) / (time.perf_counter() - start)


def measure(variant, args) -> tuple[float, float, list[list[int]]]:
    engine = build_engine(
        resolve_model(None).path, torch_dtype="bfloat16", max_num_seqs=STREAMS,
        packed_weights="false", warmup=False,
    )  # fmt: skip
    try:
        variant(engine.model)  # before the engine's first request: its thread is idle
        engine.warmup()
        prompts = chat_prompts(engine.tokenizer, 4 * STREAMS)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        single, answers = one_stream(engine, prompts[:8], params)
        return single, many_streams(engine, prompts, params), answers
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args()
    best = {name: (0.0, 0.0) for name in VARIANTS}
    answers = {}
    for _ in range(args.repeats):
        for name, variant in VARIANTS.items():
            single, batched, answers[name] = measure(variant, args)
            best[name] = (max(best[name][0], single), max(best[name][1], batched))
    print(f"SmolLM2-135M-Instruct, bf16, {torch.get_num_threads()} threads, best of {args.repeats}")
    print("| weights | 1 stream tok/s | 16 streams tok/s | ratio 1 / 16 | same tokens |")
    print("|---|---|---|---|---|")
    reference = next(iter(VARIANTS))
    for name, (single, batched) in best.items():
        same = sum(a == b for a, b in zip(answers[name], answers[reference], strict=True))
        ratio = f"{single / best[reference][0]:.2f}x / {batched / best[reference][1]:.2f}x"
        print(f"| {name} | {single:.1f} | {batched:.1f} | {ratio} | {same}/{len(answers[name])} |")


if __name__ == "__main__":
    main()
