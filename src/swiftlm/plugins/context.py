"""Who is registering: the plugin being loaded (named in every error), and its API version.

Loading a plugin pushes its label (`entry point 'demo' (swiftlm-demo 0.1.0)` or `file
/path/plugin.py`); a register_* call made while it loads is recorded as that plugin's, so a
duplicate name, a bad registration or a failure at run time names the plugin that caused it.
"""

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from swiftlm.errors import ConfigError

# The version of the API this module documents (docs/plugins.md). A plugin that needs
# "1.x" works with every 1.y where y >= x; a new major version may break plugins.
API_VERSION = "1.0"

_loading: list[str] = []


class PluginError(ConfigError):
    """A plugin that cannot be loaded or registered, or that failed while running: the
    message names the plugin (entry point and distribution, or file and line). Exit code 2."""


def current_plugin() -> str:
    """The label of the plugin being loaded, or of the code that calls register_* directly
    (its module, e.g. from a test or a script that imports swiftlm)."""
    if _loading:
        return _loading[-1]
    for frame in inspect.stack()[2:]:
        module = frame.frame.f_globals.get("__name__", "")
        if not module.startswith("swiftlm.plugins"):
            return f"module {module}"
    return "unknown code"


@contextmanager
def loading(label: str) -> Iterator[None]:
    _loading.append(label)
    try:
        yield
    finally:
        _loading.pop()


def _parse(version: str, who: str) -> tuple[int, int]:
    try:
        major, minor = (int(part) for part in str(version).split("."))
    except ValueError:
        raise PluginError(
            f'{who}: API version {version!r} is not of the form MAJOR.MINOR (e.g. "1.0")'
        ) from None
    return major, minor


def require_api(version: str) -> None:
    """Declare the plugin API version a plugin needs (e.g. `require_api("1.0")`); a version
    this swiftlm does not provide is a PluginError naming the plugin. A plugin module may
    instead set `SWIFTLM_API_VERSION = "1.0"`, checked the same way when it is loaded."""
    who = current_plugin()
    need_major, need_minor = _parse(version, who)
    have_major, have_minor = _parse(API_VERSION, "swiftlm")
    if need_major != have_major or need_minor > have_minor:
        raise PluginError(
            f"{who} needs the swiftlm plugin API {version}, but this swiftlm provides "
            f"{API_VERSION} (compatible: {have_major}.0 to {API_VERSION}); upgrade swiftlm, or "
            "install a version of the plugin made for this API"
        )
