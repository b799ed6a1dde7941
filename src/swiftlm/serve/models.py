"""What `swiftlm deploy` serves: the base model (or a run) and its named adapters.

`--adapters name=path ...` (ms-swift's form) serves each adapter as the model `name`, unmerged,
beside the base model; a bare path is named after its folder (a run's `final/` after the run).
`--ckpt_dir D` serves a run as the base model (an adapter run is merged into its base). A
reward model (`swiftlm rlhf --rlhf_type rm`) is served for scoring only (serve/scoring.py).
"""

from dataclasses import dataclass, replace
from pathlib import Path

from swiftlm.checkpoint.resolve import resolve_inference_model
from swiftlm.config import DeployConfig, InferConfig
from swiftlm.engine.build import InferenceModel
from swiftlm.engine.score import is_reward_adapter, is_reward_model
from swiftlm.errors import ConfigError
from swiftlm.infer.config import InferArguments
from swiftlm.serve.translate import ServedModels


@dataclass(frozen=True)
class DeployPlan:
    spec: InferenceModel  # the base model; its `adapters` are merged into it
    named_adapters: dict[str, str]  # served name -> adapter folder, kept unmerged
    served: ServedModels
    reward_model: bool = False  # served for scoring (serve/scoring.py), not generation


def parse_adapters(values: list[str]) -> dict[str, str]:
    """`name=path` or a bare `path` -> {name: path}; names must be unique."""
    named: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = adapter_name(value), value
        if not name or not path:
            raise ConfigError(f"--adapters {value}: expected name=path or a folder path")
        if name in named:
            raise ConfigError(f"--adapters: the name {name!r} is given twice; names must differ")
        named[name] = path
    return named


def adapter_name(path: str) -> str:
    folder = Path(path).expanduser().resolve()
    return folder.parent.name if folder.name == "final" else folder.name


def plan_deployment(cfg: DeployConfig) -> DeployPlan:
    """Resolve the flags into the base model, the adapters and the names served."""
    named = parse_adapters(cfg.infer.adapters)
    if cfg.infer.ckpt_dir and named:
        raise ConfigError(
            "--ckpt_dir and --adapters both given: serve a run alone with --ckpt_dir, or name "
            "adapters on a base --model with --adapters name=path"
        )
    infer = InferArguments(ckpt_dir=cfg.infer.ckpt_dir, adapters=list(named.values()))
    spec = resolve_inference_model(InferConfig(model=cfg.model, data=cfg.data, infer=infer))
    folders = dict(zip(named, spec.adapters, strict=True)) if named else {}
    if named:  # served unmerged, so nothing is merged into the base
        spec = replace(spec, adapters=())
    base = cfg.deploy.served_model_name or base_model_name(cfg, spec)
    if base in folders:
        raise ConfigError(
            f"--adapters {base}=...: {base!r} is the base model's name; pick another name or "
            "set --served_model_name"
        )
    refuse_named_reward_adapters(folders)
    return DeployPlan(spec, folders, ServedModels(base, tuple(folders)), is_reward_model(spec))


def refuse_named_reward_adapters(folders: dict[str, str]) -> None:
    """Named adapters share the base model's generation engine; a reward model has none."""
    for name, folder in folders.items():
        if is_reward_adapter(folder):
            raise ConfigError(
                f"--adapters {name}={folder}: a reward-model adapter cannot be served beside a "
                f"generating model; serve it alone with --ckpt_dir {folder}"
            )


def base_model_name(cfg: DeployConfig, spec: InferenceModel) -> str:
    """A run's name for --ckpt_dir; else the base model's short name (the packaged default's
    is `SmolLM2-135M-Instruct`, also when an adapter's run names no --model)."""
    if cfg.infer.ckpt_dir:
        return adapter_name(spec.ckpt_dir or cfg.infer.ckpt_dir)
    return spec.base_name or Path(spec.base_path.rstrip("/")).name
