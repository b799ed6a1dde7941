"""`swiftlm pt`: continued pre-training on plain text (loss on every token)."""

from swiftlm.config import TrainConfig
from swiftlm.train.pipeline import run_train_command


def run(cfg: TrainConfig) -> dict:
    """Pre-train on documents concatenated with EOS and cut into --max_length chunks."""
    return run_train_command(cfg, kind="text")
