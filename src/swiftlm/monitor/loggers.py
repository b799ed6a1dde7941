"""The experiment trackers behind `--report_to`: TensorBoard, Weights & Biases and SwanLab.

Each is an optional package, checked before the model loads (`check_loggers_installed`) so a
missing one costs a second and names what to install, never a silently missing logger.
A logger receives every scalar of every logged step (`log(metrics, step)`) and is closed once;
several run side by side (`--report_to tensorboard wandb swanlab`).

Each writes under the run directory (tb/, wandb/, swanlab/). wandb and swanlab are imported
only when asked for, take the run's config.yaml as their config, respect their offline modes
(WANDB_MODE, SWANLAB_MODE) and continue the same tracker run when swiftlm resumes (the id is
kept in the run directory). SwanLab never prompts: without a configured API key it runs
offline (`swanlab sync` uploads later) and says so.
"""

import importlib.util
import os
import secrets
from pathlib import Path

import yaml

from swiftlm.errors import ConfigError

# --report_to name -> (module that must import, how to install it)
LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'swiftlm[wandb]'"),
    "swanlab": ("swanlab", "pip install 'swiftlm[swanlab]'"),
}
# SWANLAB_MODE values swanlab accepts ("cloud" is its old name for "online").
SWANLAB_MODES = ("online", "cloud", "offline", "local", "disabled")


def check_loggers_installed(report_to: list[str]) -> None:
    """Raise a ConfigError naming each requested logger whose package is missing."""
    missing = [
        f"--report_to {name} needs the {module} package: {install}"
        for name, (module, install) in LOGGER_PACKAGES.items()
        if name in report_to and importlib.util.find_spec(module) is None
    ]
    if missing:
        raise ConfigError("; ".join(missing) + " (or drop it from --report_to)")
    mode = os.environ.get("SWANLAB_MODE")
    if "swanlab" in report_to and mode is not None and mode.strip() not in SWANLAB_MODES:
        raise ConfigError(
            f"--report_to swanlab: the environment variable SWANLAB_MODE is {mode!r}; set it to "
            f"one of {', '.join(SWANLAB_MODES)} (offline keeps the run local) or unset it"
        )


def _tracker_run_id(run_dir: Path, id_file: str, resume: bool) -> str:
    """The tracker's run id: the one kept in `id_file` when swiftlm resumes, else a new one
    (lowercase hex: valid for wandb and swanlab alike)."""
    path = run_dir / id_file
    if resume and path.is_file():
        return path.read_text(encoding="utf-8").strip()
    run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


def _saved_config(run_dir: Path) -> dict:
    saved = run_dir / "config.yaml"
    return yaml.safe_load(saved.read_text(encoding="utf-8")) if saved.is_file() else {}


class TensorBoardLogger:
    """Scalars and per-layer gradient histograms under <run>/tb."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def log_histograms(self, edges: list[float], layers: dict[str, list[int]], step: int) -> None:
        """Already binned log10|gradient| counts (`grad_log10_abs/<layer>`): binning happened
        once on the device, so no gradient is copied here."""
        for layer, counts in layers.items():
            total = sum(counts)
            if not total:
                continue
            centers = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:], strict=False)]
            moments = [sum(c * x**p for c, x in zip(counts, centers, strict=True)) for p in (1, 2)]
            used = [i for i, c in enumerate(counts) if c]
            self.writer.add_histogram_raw(
                f"grad_log10_abs/{layer}",
                min=edges[used[0]],
                max=edges[used[-1] + 1],
                num=total,
                sum=moments[0],
                sum_squares=moments[1],
                bucket_limits=edges[1:],
                bucket_counts=counts,
                global_step=step,
            )

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run in <run>/wandb; a resumed swiftlm run continues the same wandb run.

    The project is $WANDB_PROJECT (default "swiftlm"); WANDB_MODE=offline keeps everything
    local (`wandb sync` uploads it later). The run's config.yaml becomes the wandb config.
    """

    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir: Path, resume: bool):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "swiftlm"),
            name=run_dir.name,
            id=_tracker_run_id(run_dir, self.ID_FILE, resume),
            resume="allow",
            dir=str(run_dir),
            config=_saved_config(run_dir),
            # Leave the terminal to swiftlm's progress bar: wandb would wrap stdout/stderr.
            settings=wandb.Settings(console="off"),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def log_histograms(self, edges: list[float], layers: dict[str, list[int]], step: int) -> None:
        """Per-layer log10|gradient| histograms, already binned (`grad_log10_abs/<layer>`)."""
        import wandb

        self.run.log(
            {
                f"grad_log10_abs/{layer}": wandb.Histogram(np_histogram=(counts, edges))
                for layer, counts in layers.items()
            },
            step=step,
        )

    def close(self) -> None:
        self.run.finish()


def _swanlab_has_key() -> bool:
    """Whether swanlab would find an API key ($SWANLAB_API_KEY, or a `swanlab login` kept in
    its .netrc) — read through its own settings, so every place it looks is covered."""
    if os.environ.get("SWANLAB_API_KEY"):
        return True
    try:
        from swanlab.sdk.internal.settings import create_settings

        return create_settings().api_key is not None
    except Exception:  # noqa: BLE001 - another swanlab version: no key we can see, stay local
        return False


def swanlab_mode() -> str | None:
    """The mode to start swanlab in: None lets SWANLAB_MODE (or a configured key: online)
    decide; "offline" when neither is set, where swanlab would otherwise prompt for a login
    or fail."""
    if os.environ.get("SWANLAB_MODE") or _swanlab_has_key():
        return None
    print(
        "swanlab: no API key configured (swanlab login, or $SWANLAB_API_KEY), so the run is "
        "kept offline in the run directory; upload it with `swanlab sync`, or set SWANLAB_MODE"
    )
    return "offline"


class SwanlabLogger:
    """A swanlab run in <run>/swanlab; a resumed swiftlm run continues the same swanlab run.

    The project is $SWANLAB_PROJECT (default "swiftlm"); SWANLAB_MODE (online, offline, local,
    disabled) is respected, and without it or an API key the run stays offline (see
    `swanlab_mode`). The run's config.yaml becomes the swanlab config.
    """

    ID_FILE = "swanlab_run_id"

    def __init__(self, run_dir: Path, resume: bool):
        import swanlab

        self.run = swanlab.init(
            project=os.environ.get("SWANLAB_PROJECT", "swiftlm"),
            name=run_dir.name,
            id=_tracker_run_id(run_dir, self.ID_FILE, resume),
            resume="allow",
            log_dir=str(run_dir / "swanlab"),
            mode=swanlab_mode(),
            config=_saved_config(run_dir),
            reinit=True,  # a run of the same process that failed may have left one open
            # Never prompt for a login (a training job must not wait on stdin), and leave the
            # terminal to swiftlm's progress bar: swanlab would wrap stdout/stderr.
            settings=swanlab.Settings(interactive=False, terminal={"proxy_type": "none"}),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_loggers(run_dir: Path, report_to: list[str], resume: bool) -> list:
    """The loggers `--report_to` asks for ("none" and an empty list: none)."""
    makers = {
        "tensorboard": lambda: TensorBoardLogger(run_dir),
        "wandb": lambda: WandbLogger(run_dir, resume),
        "swanlab": lambda: SwanlabLogger(run_dir, resume),
    }
    return [makers[name]() for name in report_to if name in makers]
