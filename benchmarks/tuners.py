"""Trainable parameters, adapter size and step time of every --train_type (and LoRA+, PiSSA,
LISA) vs LoRA, on the default model (SmolLM2-135M-Instruct).

    python benchmarks/tuners.py [--steps 5] [--seq 256] [--only lora,vera]

Each tuner is applied by swiftlm's own `apply_tuner` with the flags' defaults (rank 8,
alpha 32, all linear layers; OFT/BOFT: blocks of 8; IA3: peft's keys/values/MLP-out targets;
LISA: 2 of the 30 decoder layers plus embeddings and head), on the model in float32, then
`--steps` AdamW steps on one row of `--seq` random tokens run in this process. Reported:

- trainable: parameters that train (LISA: those of one sampling window);
- saved: the bytes of what final/ holds (adapter_model.safetensors; full and LISA: the model);
- step: the median over the steps after the first of forward + backward + AdamW step.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

# (label, TunerArguments fields)
TUNERS = (
    ("lora", dict(train_type="lora")),
    ("lora+ (ratio 16)", dict(train_type="lora", lorap_lr_ratio=16.0)),
    ("pissa_niter_4", dict(train_type="lora", init_weights="pissa_niter_4")),
    ("dora", dict(train_type="dora")),
    ("vera", dict(train_type="vera")),
    ("loha", dict(train_type="loha")),
    ("lokr", dict(train_type="lokr")),
    ("oft", dict(train_type="oft")),
    ("boft", dict(train_type="boft")),
    ("ia3", dict(train_type="ia3")),
    ("lisa (2 layers)", dict(train_type="full", lisa_activated_layers=2)),
    ("full", dict(train_type="full")),
)


def build(fields: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from swiftlm.models.loader import resolve_model
    from swiftlm.tuners.config import TunerArguments
    from swiftlm.tuners.hooks import TunerHooks
    from swiftlm.tuners.lora_plus import tuner_param_groups
    from swiftlm.tuners.setup import apply_tuner

    torch.manual_seed(0)
    path = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = TunerArguments(lora_dropout=0.0, **fields)
    model = apply_tuner(model, args)
    groups = tuner_param_groups(model, args.lorap_lr_ratio)
    optimizer = torch.optim.AdamW(
        [{"params": g.params, "lr": 1e-4 * g.lr_scale} for g in groups], lr=1e-4
    )
    hooks = TunerHooks(model, args, seed=0, log=lambda _: None)
    hooks.start(0)  # LISA freezes all but its sampled layers
    return model.train(), optimizer


def saved_bytes(model) -> int:
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, safe_serialization=True)
        return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def measure(label: str, fields: dict, steps: int, seq: int) -> dict:
    import torch

    model, optimizer = build(fields)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ids = torch.randint(
        0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)
    )
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {
        "label": label,
        "trainable": trainable,
        "saved": saved_bytes(model),
        "step_s": statistics.median(times[1:]),
    }


def table(results: list[dict]) -> str:
    lora = next(r for r in results if r["label"] == "lora")
    lines = [
        "| tuner | trainable params | vs LoRA | saved (final/) | step | vs LoRA |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['trainable']:,} | {r['trainable'] / lora['trainable']:.2f}x "
            f"| {r['saved'] / 2**20:.2f} MiB | {r['step_s']:.2f} s "
            f"| {r['step_s'] / lora['step_s']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps per tuner (>= 2)")
    parser.add_argument("--seq", type=int, default=256, help="tokens in the one training row")
    parser.add_argument("--only", default="", help="comma-separated labels (default: all)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    results = []
    for label, fields in TUNERS:
        if only and label not in only and label != "lora":
            continue
        results.append(measure(label, fields, args.steps, args.seq))
        print(results[-1], flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
