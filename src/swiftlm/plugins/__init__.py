"""`swiftlm.plugins`: the public, versioned API through which packages and files add dataset
formats, training methods, losses, reward functions, chat templates, tool-call parsers,
evaluation tasks, model loaders and training callbacks (reference: docs/plugins.md).

A plugin is a module that calls the register_* functions (at import, or in a `register()`
function). swiftlm loads the installed packages' `swiftlm.plugins` entry points and the files
given with `--external_plugins` before it parses a command's flags. Each register_* function
adds to the plain-dict registry of the layer that uses it, refuses a name already taken
(naming both plugins) unless `replace=True`, and wraps the plugin's code so that a failure is
a PluginError naming the plugin.

API_VERSION is MAJOR.MINOR: a minor version only adds; a plugin that declares "1.0" works
with every 1.x. `require_api("1.0")` (or `SWIFTLM_API_VERSION = "1.0"` in the module) makes a
mismatch a clear error instead of a failure somewhere later.
"""

from swiftlm.data.rows import RowError
from swiftlm.plugins.context import API_VERSION, PluginError, require_api
from swiftlm.plugins.loading import ENTRY_POINT_GROUP, load_plugins, loaded_plugins
from swiftlm.plugins.registry import (
    register_callback,
    register_chat_template,
    register_dataset_format,
    register_eval_task,
    register_loss,
    register_method,
    register_model_loader,
    register_reward,
    register_tool_parser,
    registered_by,
)

__all__ = [
    "API_VERSION",
    "ENTRY_POINT_GROUP",
    "PluginError",
    "RowError",
    "load_plugins",
    "loaded_plugins",
    "register_callback",
    "register_chat_template",
    "register_dataset_format",
    "register_eval_task",
    "register_loss",
    "register_method",
    "register_model_loader",
    "register_reward",
    "register_tool_parser",
    "registered_by",
    "require_api",
]
