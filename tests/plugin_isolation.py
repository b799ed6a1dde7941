"""A fixture that gives each test fresh plugin registries: what a test's plugins register (and
the loader's memory of loaded files and entry points) is undone afterwards, so later tests in
the same process see only swiftlm's built-ins."""

import copy
from contextlib import contextmanager

import pytest


def _registries() -> list:
    from swiftlm.data.row_formats import ROW_FORMATS
    from swiftlm.evaluation.task_file import BUILTIN_TASKS
    from swiftlm.losses.causal_lm import TOKEN_LOSSES
    from swiftlm.methods.config import RLHF_METHODS
    from swiftlm.methods.registry import METHODS
    from swiftlm.methods.rl.rewards import REWARD_FUNCS
    from swiftlm.models.loader import MODEL_LOADERS
    from swiftlm.models.templates import CHAT_TEMPLATES
    from swiftlm.plugins import loading, registry
    from swiftlm.serve.tools import FORCED_CALL_TAGS, TOOL_PARSERS
    from swiftlm.train.callbacks import CALLBACKS

    return [
        RLHF_METHODS, ROW_FORMATS, BUILTIN_TASKS, TOKEN_LOSSES, METHODS, REWARD_FUNCS,
        MODEL_LOADERS, CHAT_TEMPLATES, TOOL_PARSERS, FORCED_CALL_TAGS, CALLBACKS, registry._OWNERS,
        loading._loaded, loading._files_done,
    ]  # fmt: skip


@contextmanager
def fresh_registries(entry_points_done: bool = True):
    from swiftlm.plugins import loading

    saved = [copy.copy(registry) for registry in _registries()]
    was_done = loading._entry_points_done
    loading._entry_points_done = entry_points_done  # the test environment's own: none
    try:
        yield
    finally:
        for registry, before in zip(_registries(), saved, strict=True):
            if isinstance(registry, list):
                registry[:] = before
            else:
                registry.clear()
                registry.update(before)
        loading._entry_points_done = was_done


@pytest.fixture
def isolated_plugins():
    with fresh_registries():
        yield
