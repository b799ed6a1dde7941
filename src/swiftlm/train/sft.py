"""`swiftlm sft`: supervised fine-tuning on conversations (loss on assistant turns)."""

from swiftlm.config import TrainConfig
from swiftlm.methods.sft import SFT
from swiftlm.train.run import run_method


def run(cfg: TrainConfig) -> dict:
    """Fine-tune `cfg.model.model` on `cfg.data.dataset`; returns the run summary."""
    return run_method(cfg, SFT)
