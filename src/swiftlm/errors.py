"""User-facing errors. The CLI prints their message (no traceback) and exits non-zero."""


class SwiftLMError(Exception):
    """An error whose message tells the user what is wrong and how to fix it."""

    exit_code = 1


class ConfigError(SwiftLMError):
    """A bad flag, config file or combination of options."""

    exit_code = 2


class DataError(SwiftLMError):
    """A dataset that cannot be read or has invalid rows."""


class ModelLoadError(SwiftLMError):
    """A model or tokenizer that cannot be found or loaded."""


class CheckpointError(SwiftLMError):
    """A checkpoint that is missing, incomplete or does not match the run."""


class ExportCheckError(SwiftLMError):
    """An exported model that, read back, does not reproduce the model it was made from."""
