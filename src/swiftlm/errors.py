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


class Preempted(SwiftLMError):
    """SIGTERM or SIGUSR1 stopped the run after it saved a complete checkpoint of the step.

    Its own exit status (not 1/2: nothing is wrong; not 75: the heartbeat's hang; not 128+N:
    a process killed by signal N before it could save), so that a scheduler can requeue on
    it: e.g. a Kubernetes podFailurePolicy `onExitCodes: [99]`, or a SLURM batch script's
    `[ $? -eq 99 ] && scontrol requeue $SLURM_JOB_ID`. The requeued job resumes with
    `--resume_from_checkpoint auto`.
    """

    exit_code = 99

    def __init__(self, message: str, signal_name: str = "SIGTERM"):
        super().__init__(message)
        self.signal_name = signal_name
