"""TRL's SFTTrainer (+ peft for LoRA) with the benchmark's matched settings.

TRL has no fine-tuning CLI that takes every setting the benchmark pins, so run.py starts this
script in the TRL venv. Everything here is plain, documented TRL/peft API.

    .venvs/trl/bin/python trl_sft.py --model DIR --dataset FILE --mode lora|full --steps N \
        --learning_rate LR --dtype bf16|fp32 --output_dir DIR
"""

import argparse

import torch
from datasets import load_dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--mode", choices=["lora", "full"], required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--learning_rate", type=float, required=True)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--lora_alpha", type=int, default=32)
    parser.add_argument("--adam_beta2", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def sft_config(args: argparse.Namespace) -> SFTConfig:
    return SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=args.adam_beta2,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        # bf16: fp32 weights, bf16 autocast (Trainer's AMP); fp32: no autocast.
        bf16=args.dtype == "bf16",
        fp16=False,
        # On a machine without CUDA the Trainer refuses bf16 unless told it runs on the CPU.
        use_cpu=not torch.cuda.is_available(),
        # Weights load as stored (float32) in both modes, like swiftlm's master weights.
        model_init_kwargs={"dtype": torch.float32},
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        gradient_checkpointing=False,  # TRL's default is True; the benchmark turns it off everywhere
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        dataset_num_proc=1,
        max_length=args.max_length,
        truncation_mode="keep_start",  # right truncation; over-long samples are kept
        packing=False,
        padding_free=False,
        # Loss on assistant turns only: the ChatML template marks each answer + <|im_end|>
        # with {% generation %}, which is what assistant_only_loss reads.
        assistant_only_loss=True,
    )


def main() -> None:
    args = parse_args()
    dataset = load_dataset("json", data_files=args.dataset, split="train")
    peft_config = None
    if args.mode == "lora":
        peft_config = LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    trainer = SFTTrainer(
        model=args.model, args=sft_config(args), train_dataset=dataset, peft_config=peft_config
    )
    trainer.train()


if __name__ == "__main__":
    main()
