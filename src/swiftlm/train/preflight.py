"""What a training run checks before it loads anything, so that a typo costs a second.

`prepare_run` runs once, on rank 0, after the rules between flags and before the model is
found (a GGUF file is converted then), the tokenizer loads or a dataset is read:

1. every path a flag names (`check_paths`): --output_dir is not a file, each local
   --dataset / --val_dataset exists, a --resume_from_checkpoint folder is a complete
   checkpoint;
2. the run directory (`rundir.settle_run_dir`): new, cleared, versioned or continued;
3. a resumed run against the run that saved its checkpoint (`resume_match`).

Under torchrun the other ranks wait for rank 0's result (the settled config); a worker that
torchrun restarted passes here and resumes (see `rundir`).
"""

import torch

from swiftlm.checkpoint.targets import not_resumable
from swiftlm.config import TrainConfig
from swiftlm.config.paths import check_writable_folder
from swiftlm.data.sources import check_dataset_paths
from swiftlm.errors import CheckpointError
from swiftlm.train.resolve import resolve_defaults
from swiftlm.train.resume_match import check_resume_matches
from swiftlm.train.rundir import settle_run_dir


def prepare_run(cfg: TrainConfig, method_cls, ctx, device: torch.device, log) -> TrainConfig:
    """Check every path of `cfg` and settle its run directory; return the settled config.
    `ctx`: the processes of the run (`distributed.env`), `device`: rank 0's."""
    check_paths(cfg)
    cfg = settle_run_dir(cfg, log)
    if cfg.output.resume_from_checkpoint:
        # Compared with the saved (resolved) values: unset flags as they would resolve.
        resolved = resolve_defaults(cfg, method_cls, device)
        check_resume_matches(resolved, ctx.world_size, log)
    return cfg


def check_paths(cfg: TrainConfig) -> None:
    """Raise a SwiftLMError naming the first path flag whose path cannot be what it needs."""
    if cfg.output.output_dir is not None:
        check_writable_folder(cfg.output.output_dir, "--output_dir")
    check_dataset_paths(cfg.data)
    resume = cfg.output.resume_from_checkpoint
    problem = not_resumable(resume) if resume not in (None, "auto") else None
    if problem:
        raise CheckpointError(problem)
