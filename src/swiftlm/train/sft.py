"""`swiftlm sft`: supervised fine-tuning on conversations (loss on assistant turns)."""

from swiftlm.config import TrainConfig
from swiftlm.train.pipeline import run_train_command


def run(cfg: TrainConfig) -> dict:
    """Fine-tune `cfg.model.model` on `cfg.data.dataset`; returns the run summary."""
    return run_train_command(cfg, kind="chat")
