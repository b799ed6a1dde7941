"""The TRL side of benchmarks/alignment.py: runs in TRL's own venv, never imports swiftlm.

    .venvs/trl/bin/python alignment_trl.py check --model DIR --pairs FILE --adapter FILE --out FILE
    .venvs/trl/bin/python alignment_trl.py dpo  --model DIR --dataset FILE --steps N --output_dir D
    .venvs/trl/bin/python alignment_trl.py grpo --model DIR --dataset FILE --steps N --output_dir D

check: one DPOTrainer forward + backward on all pairs of FILE as one batch, in their order,
with the LoRA adapter weights of --adapter (so the policy differs from its reference, the
base model with the adapter disabled); writes the loss, the logged rewards, the tokenized
batch and every adapter gradient to --out (torch.save).
dpo / kto / grpo: a short DPOTrainer / KTOTrainer / GRPOTrainer run (no vLLM) with the settings alignment.py
passes. Step times: `StepTimes` writes the line the frameworks benchmark's hook would
(hooks/sitecustomize.py, at on_step_end) to $BENCH_STEP_LOG; the hook itself is taken out
here, since it expects every Trainer's inputs to be a dict and GRPOTrainer's are a list.
"""

import sys

# Before transformers.trainer is imported: drop the frameworks hook's import patcher.
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "PatchAfterImport"]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer  # noqa: E402

CHECK_LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["check", "dpo", "kto", "grpo"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--pairs", help="check: the preference pairs (TRL layout, jsonl)")
    parser.add_argument("--adapter", help="check: LoRA weights (safetensors, peft names)")
    parser.add_argument("--out", help="check: where to torch.save the results")
    parser.add_argument("--dataset", help="dpo, kto, grpo: the training rows (jsonl)")
    parser.add_argument("--output_dir", default="trl-out")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--lora_alpha", type=int, default=32)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def common_config(args: argparse.Namespace) -> dict:
    """The HF Trainer settings both timed runs share with swiftlm's (see alignment.py)."""
    return dict(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        bf16=args.dtype == "bf16",
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
        model_init_kwargs={"dtype": torch.float32},
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        gradient_checkpointing=False,
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
    )


class StepTimes(TrainerCallback):
    """One JSON line per optimizer step to $BENCH_STEP_LOG, as the frameworks hook writes."""

    def on_step_end(self, args, state, control, **kwargs):
        path = os.environ.get("BENCH_STEP_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                row = {"event": "step", "step": state.global_step, "time": time.time()}
                f.write(json.dumps(row) + "\n")


class MetricsFile(TrainerCallback):
    """Every logged dict to <output_dir>/metrics.jsonl (swiftlm's file name), one per line."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            path = Path(args.output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def lora(args: argparse.Namespace) -> LoraConfig:
    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


# -- check ---------------------------------------------------------------------------------------


def check(args: argparse.Namespace) -> None:
    pairs = load_dataset("json", data_files=args.pairs, split="train")
    args.batch_size = len(pairs)
    config = DPOConfig(
        **{**common_config(args), "bf16": False, "max_steps": 1},
        dataset_num_proc=1,
        beta=args.beta,
        loss_type=["sigmoid"],
        max_length=None,
    )
    peft_config = LoraConfig(**CHECK_LORA, lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = DPOTrainer(
        model=args.model, args=config, train_dataset=pairs, peft_config=peft_config
    )
    model = trainer.model
    load_adapter(model, args.adapter)
    model.train()
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    inputs = trainer._prepare_inputs(trainer.data_collator(rows))
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(
        {
            "loss": loss.item(),
            "metrics": metrics,
            "input_ids": inputs["input_ids"].cpu(),
            "attention_mask": inputs["attention_mask"].cpu(),
            "completion_mask": inputs["completion_mask"].cpu(),
            "grads": grads,
        },
        args.out,
    )


def load_adapter(model, path: str) -> None:
    """Copy the saved adapter weights (peft names with `.default`) into the trainer's model."""
    weights = load_file(path)
    params = dict(model.named_parameters())
    missing = sorted(set(weights) - set(params))
    if missing:
        raise KeyError(f"adapter weights without a parameter in TRL's model: {missing[:3]}")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


# -- timed runs ----------------------------------------------------------------------------------


def dpo(args: argparse.Namespace) -> None:
    config = DPOConfig(
        **common_config(args),
        dataset_num_proc=1,
        beta=args.beta,
        loss_type=["sigmoid"],
        max_length=args.max_length,
        truncation_mode="keep_start",
    )
    dataset = load_dataset("json", data_files=args.dataset, split="train")
    trainer = DPOTrainer(
        model=args.model,
        args=config,
        train_dataset=dataset,
        peft_config=lora(args),
        callbacks=[StepTimes(), MetricsFile()],
    )
    trainer.train()


def kto(args: argparse.Namespace) -> None:
    """KTOTrainer on the DPO pairs unpaired: each pair gives its chosen answer (desirable)
    then its rejected one (undesirable), the order swiftlm's KTO reads a pair in."""
    from datasets import Dataset

    rows = []
    for line in Path(args.dataset).read_text().splitlines():
        pair = json.loads(line)
        for side, label in (("chosen", True), ("rejected", False)):
            rows.append({"prompt": pair["prompt"], "completion": pair[side], "label": label})
    config = KTOConfig(
        **common_config(args),
        dataset_num_proc=1,
        beta=args.beta,
        loss_type="kto",
        max_length=args.max_length,
    )
    trainer = KTOTrainer(
        model=args.model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        peft_config=lora(args),
        callbacks=[StepTimes(), MetricsFile()],
    )
    trainer.train()


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def accuracy(completions, solution, **_) -> list[float]:
    """1 when the completion's last number equals the row's `solution`, else 0."""
    rewards = []
    for completion, answer in zip(completions, solution, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = NUMBER.findall(text)
        rewards.append(float(bool(numbers) and float(numbers[-1]) == float(answer)))
    return rewards


def grpo(args: argparse.Namespace) -> None:
    config = GRPOConfig(
        **common_config(args),
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        beta=args.beta,
        loss_type="grpo",  # swiftlm's default (TRL's is "dapo"); the step's work is the same
        use_vllm=False,
        log_completions=False,
    )
    dataset = load_dataset("json", data_files=args.dataset, split="train")
    GRPOTrainer(
        model=args.model,
        reward_funcs=accuracy,
        args=config,
        train_dataset=dataset,
        peft_config=lora(args),
        callbacks=[StepTimes(), MetricsFile()],
    ).train()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    {"check": check, "dpo": dpo, "kto": kto, "grpo": grpo}[args.command](args)


if __name__ == "__main__":
    main()
