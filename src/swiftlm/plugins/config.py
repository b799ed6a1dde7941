"""The plugin flags every command accepts (`swiftlm.plugins`), and the ones training adds.

`--external_plugins` is read twice: by the CLI before the flags are parsed (plugins may add
choices the parser checks, e.g. a `--reward_funcs` name), and here, so that it lands in the
run's config.yaml and a rerun from that file loads the same plugins.
"""

from dataclasses import dataclass

from swiftlm.config.sections import doc


@dataclass
class PluginArguments:
    external_plugins: list[str] = doc(
        "Python files that register swiftlm plugins (formats, losses, rewards, templates, "
        "tool parsers, eval tasks, model loaders, callbacks; see docs/plugins.md), loaded "
        "before the flags are checked, after the installed `swiftlm.plugins` entry points.",
        default_factory=list,
    )


@dataclass
class TrainPluginArguments(PluginArguments):
    loss_type: str | None = doc(
        "sft/pt: a token loss registered by a plugin (swiftlm.plugins.register_loss) to train "
        "with instead of the built-in next-token cross-entropy. Default: the built-in one.",
        default=None,
    )
    dataset_format: str | None = doc(
        "sft/pt: read every --dataset/--val_dataset row with this registered dataset format "
        "(swiftlm.plugins.register_dataset_format). Default: detect each row's format.",
        default=None,
    )
