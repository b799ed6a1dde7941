"""Command configs, each a composition of typed sections.

- `sections.py` (training, model, data, quantization), `sections_dist.py` (processes,
  nodes, parallel strategies) and `sections_infer.py` (generation,
  inference, export), `sections_serve.py` (deploy) and `sections_rlhf.py` (rlhf): the sections; each checks its own fields (`checks.py`) when built;
- `commands.py`: each command's config, and the flags each command reads (`READS`, an
  allow-list per section; `UNUSED_FLAGS`, what its parser leaves out, is derived from it);
- `argv.py`: repeated and aliased flags resolved before argparse;
- `rules.py`: every rule between flags, run once by a command with `rules.check(cfg)`;
- `parse.py`: a config from a YAML file plus flags, and back to config.yaml.
"""

from swiftlm.config.commands import (
    UNUSED_FLAGS,
    DeployConfig,
    EvalConfig,
    ExportConfig,
    InferConfig,
    PlanConfig,
    ReportConfig,
    RLHFConfig,
    TrainConfig,
    WebConfig,
)
from swiftlm.config.parse import load_saved_config, parse_config, save_config
from swiftlm.config.sections import (
    DataArguments,
    ModelArguments,
    OutputArguments,
    QuantArguments,
    TrainArguments,
    TunerArguments,
)
from swiftlm.config.sections_dist import DistArguments
from swiftlm.config.sections_infer import ExportArguments, GenerationArguments, InferArguments
from swiftlm.config.sections_rlhf import RLHFArguments
from swiftlm.config.sections_serve import DeployArguments

__all__ = [
    "DataArguments",
    "DeployArguments",
    "DeployConfig",
    "EvalConfig",
    "DistArguments",
    "ExportArguments",
    "ExportConfig",
    "GenerationArguments",
    "InferArguments",
    "InferConfig",
    "PlanConfig",
    "ReportConfig",
    "ModelArguments",
    "OutputArguments",
    "QuantArguments",
    "RLHFArguments",
    "RLHFConfig",
    "TrainArguments",
    "TrainConfig",
    "TunerArguments",
    "UNUSED_FLAGS",
    "WebConfig",
    "load_saved_config",
    "parse_config",
    "save_config",
]
