"""How flags and YAML become a command's config. The sections themselves live beside their
features (`train/config.py`, `data/config.py`, `methods/config.py`, ...: each a leaf module
that imports only this package's field helpers), so a feature's flags are edited where
its code is; this package composes them.

- `sections.py`: `doc` (a field and its `--help` text), `flag_type`, and the one section
  every writing command shares (`OverwriteArguments`); `checks.py`: the per-field checks a
  section runs when built;
- `commands.py`: each command's config, a composition of sections, and the flags each
  command reads (`READS`, an allow-list per section; `UNUSED_FLAGS`, what its parser leaves
  out, is derived from it);
- `argv.py`: repeated and aliased flags resolved before argparse;
- `rules.py`: every rule between flags, run once by a command with `rules.check(cfg)`;
- `parse.py`: a config from a YAML file plus flags, and back to config.yaml.
"""

# Loaded on first use (PEP 562): the sections beside the features import this package's
# helpers (`checks`, `sections`), and `commands` imports those sections back.
_COMMANDS = (
    "DeployConfig", "EvalConfig", "ExportConfig", "InferConfig", "PlanConfig", "ReportConfig",
    "RLHFConfig", "RolloutConfig", "TrainConfig", "UNUSED_FLAGS", "WebConfig",
)  # fmt: skip
_PARSING = ("load_saved_config", "parse_config", "save_config")
__all__ = [*_COMMANDS, *_PARSING]


def __getattr__(name: str):
    if name in _COMMANDS:
        from swiftlm.config import commands

        return getattr(commands, name)
    if name in _PARSING:
        from swiftlm.config import parse

        return getattr(parse, name)
    raise AttributeError(f"module 'swiftlm.config' has no attribute {name!r}")
