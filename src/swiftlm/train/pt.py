"""`swiftlm pt`: continued pre-training on plain text (loss on every token)."""

from swiftlm.config import TrainConfig
from swiftlm.methods.pt import PT
from swiftlm.train.run import run_method


def run(cfg: TrainConfig) -> dict:
    """Pre-train on documents concatenated with EOS and cut into --max_length chunks."""
    return run_method(cfg, PT)
