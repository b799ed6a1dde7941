"""Where one swiftlm DPO step's time goes: policy forward, reference forward, backward.

    .venv/bin/python benchmarks/alignment_profile.py [--model DIR] [--dtype fp32|bf16] [--repeats 3]

Same batch as benchmarks/alignment.py's DPO timing (4 pairs of swiftlm/concise-preference,
LoRA r 8 alpha 32 on all linear layers, beta 0.1, sigmoid); each phase is timed on its own
(median of --repeats), then torch.profiler lists the top operators of one whole step.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swiftlm.config import RLHFConfig
from swiftlm.config.parse import from_flat_dict
from swiftlm.losses.causal_lm import token_cross_entropy
from swiftlm.methods.base import Layout
from swiftlm.methods.preference.dpo import answer_logps
from swiftlm.methods.registry import METHODS

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "src" / "swiftlm" / "assets" / "concise_preference.jsonl"


def build(model_dir: str, dtype: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = from_flat_dict(RLHFConfig, {"beta": 0.1, "loss_type": "sigmoid", "max_length": 512})
    method = METHODS["dpo"](cfg, AutoTokenizer.from_pretrained(model_dir))
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:4]]
    samples = method.encode([method.to_sample(row) for row in rows]).samples
    batch = method.collate(Layout([[s] for s in samples], False))
    weights = torch.bfloat16 if dtype == "bf16" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights)
    lora = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(base, lora)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return method, model.train(), batch


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="default: swiftlm's default model")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from swiftlm.models.loader import resolve_model

        args.model = resolve_model(None).path
    method, model, batch = build(args.model, args.dtype)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=args.dtype == "bf16")
    shape = tuple(batch["input_ids"].shape)
    pad = 1 - batch["attention_mask"].float().mean().item()
    print(f"batch {shape} (2B rows x length), padding {pad:.1%}, dtype {args.dtype}")

    def policy_forward():
        with autocast, torch.no_grad():
            answer_logps(model, batch)

    def logits_only():
        with autocast, torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    def reference_forward():
        with autocast, torch.no_grad(), model.disable_adapter():
            answer_logps(model, batch)

    def step():
        with autocast:
            loss, _ = method.loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    phases = {
        "policy forward (no grad), logits only": logits_only,
        "policy forward (no grad) + log-probs": policy_forward,
        "reference forward (adapter off)": reference_forward,
        "whole loss + backward": step,
    }
    step()  # warm-up
    for name, fn in phases.items():
        print(f"{name}: {timed(fn, args.repeats):.2f} s")
    with autocast, torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    print(f"cross-entropy over {tuple(logits.shape)}: "
          f"{timed(lambda: token_cross_entropy(logits, batch['labels']), args.repeats):.3f} s")  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
