"""The experiment trackers behind `--report_to`: TensorBoard and Weights & Biases.

Each is an optional package, checked before the model loads (`check_loggers_installed`) so a
missing one costs a second and names what to install, never a silently missing logger.
A logger receives every scalar of every logged step (`log(metrics, step)`) and is closed once.
"""

import importlib.util
import secrets
from pathlib import Path

import yaml

from swiftlm.errors import ConfigError

# --report_to name -> (module that must import, how to install it)
LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'swiftlm[wandb]'"),
}


def check_loggers_installed(report_to: list[str]) -> None:
    """Raise a ConfigError naming each requested logger whose package is missing."""
    missing = [
        f"--report_to {name} needs the {module} package: {install}"
        for name, (module, install) in LOGGER_PACKAGES.items()
        if name in report_to and importlib.util.find_spec(module) is None
    ]
    if missing:
        raise ConfigError("; ".join(missing) + " (or drop it from --report_to)")


class TensorBoardLogger:
    """Scalars under <run>/tb."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run in <run>/wandb; a resumed swiftlm run continues the same wandb run.

    The project is $WANDB_PROJECT (default "swiftlm"); WANDB_MODE=offline keeps everything
    local (`wandb sync` uploads it later). The run's config.yaml becomes the wandb config.
    """

    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir: Path, resume: bool):
        import os

        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "swiftlm"),
            name=run_dir.name,
            id=self._run_id(run_dir, resume),
            resume="allow",
            dir=str(run_dir),
            config=self._config(run_dir),
            # Leave the terminal to swiftlm's progress bar: wandb would wrap stdout/stderr.
            settings=wandb.Settings(console="off"),
        )

    def _run_id(self, run_dir: Path, resume: bool) -> str:
        path = run_dir / self.ID_FILE
        if resume and path.is_file():
            return path.read_text(encoding="utf-8").strip()
        run_id = secrets.token_hex(4)
        path.write_text(run_id + "\n", encoding="utf-8")
        return run_id

    @staticmethod
    def _config(run_dir: Path) -> dict:
        saved = run_dir / "config.yaml"
        return yaml.safe_load(saved.read_text(encoding="utf-8")) if saved.is_file() else {}

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_loggers(run_dir: Path, report_to: list[str], resume: bool) -> list:
    """The loggers `--report_to` asks for ("none" and an empty list: none)."""
    makers = {
        "tensorboard": lambda: TensorBoardLogger(run_dir),
        "wandb": lambda: WandbLogger(run_dir, resume),
    }
    return [makers[name]() for name in report_to if name in makers]
