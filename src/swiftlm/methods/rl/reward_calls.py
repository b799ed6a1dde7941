"""User reward functions (`--reward_funcs my_rewards.py:fn`), run in a worker process with a
timeout, so that a function that hangs or crashes costs a timeout, never the run.

The worker is a spawned Python process that imports the user's file once and then answers
calls over a pipe. A call that raises comes back as the exception's text; a call that takes
longer than --reward_timeout gets its worker killed (a hung thread could not be stopped) and
a fresh worker starts at the next call. Results are checked: one number (or None: "no
reward for this completion", as TRL) per completion.
"""

import importlib.util
import math
import multiprocessing
import traceback
from dataclasses import dataclass
from pathlib import Path

from swiftlm.errors import ConfigError

STARTUP_TIMEOUT = 120  # seconds for a worker to import swiftlm and the user's file


@dataclass
class CallResult:
    """Rewards of one call (None entries: no reward), or why the call failed."""

    rewards: list[float | None] | None
    error: str | None = None


def split_spec(spec: str) -> tuple[Path, str]:
    """`path.py:function` -> (path, function name), checked to exist (ConfigError)."""
    file, _, function = spec.rpartition(":")
    path = Path(file).expanduser()
    if not file or not function:
        raise ConfigError(f"--reward_funcs {spec}: expected file.py:function")
    if not path.is_file():
        raise ConfigError(f"--reward_funcs {spec}: the file {path} does not exist")
    return path.resolve(), function


def load_function(path: Path, name: str, spec: str):
    """Import `path` and return its callable `name` (ConfigError naming the problem)."""
    module_spec = importlib.util.spec_from_file_location(f"swiftlm_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"--reward_funcs {spec}: importing {path} failed: {exc!r}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"--reward_funcs {spec}: {path} has no function {name!r}")
    return function


def _serve(connection, path: str, name: str, spec: str) -> None:
    """The worker's loop: say ready, then call the function on each request and send back
    rewards or an error."""
    try:
        function = load_function(Path(path), name, spec)
    except ConfigError as exc:
        connection.send(("error", str(exc)))
        return
    connection.send(("ready", None))
    while True:
        kwargs = connection.recv()
        if kwargs is None:
            return
        try:
            connection.send(("ok", function(**kwargs)))
        except Exception as exc:
            line = traceback.format_exception_only(type(exc), exc)[-1].strip()
            connection.send(("error", line))


class UserReward:
    """One `file.py:function` reward, called through its worker process."""

    def __init__(self, spec: str, timeout: float):
        self.spec, self.timeout = spec, timeout
        self.path, self.function = split_spec(spec)
        load_function(self.path, self.function, spec)  # fail at start, not at step 1
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded trainer
        self._process = None
        self._connection = None

    def __call__(self, **kwargs) -> CallResult:
        count = len(kwargs["completions"])
        problem = self._start()
        if problem:
            return CallResult(None, problem)
        try:
            self._connection.send(kwargs)
        except (BrokenPipeError, OSError) as exc:  # the worker died (e.g. the function exited)
            self.close()
            return CallResult(None, f"the reward worker died ({exc})")
        if not self._connection.poll(self.timeout):
            self.close()
            return CallResult(None, f"timed out after {self.timeout:g} s (--reward_timeout)")
        try:
            status, value = self._connection.recv()
        except EOFError:
            self.close()
            return CallResult(None, "the reward worker exited during the call")
        if status == "error":
            return CallResult(None, value)
        return _checked(value, count)

    def _start(self) -> str | None:
        """Start the worker if none runs; wait until it has imported the function (not
        counted in --reward_timeout: a spawned Python imports swiftlm first). The problem,
        or None."""
        if self._process is not None and self._process.is_alive():
            return None
        ours, theirs = self._context.Pipe()
        self._process = self._context.Process(
            target=_serve,
            args=(theirs, str(self.path), self.function, self.spec),
            daemon=True,
            name=f"swiftlm-reward-{self.function}",
        )
        self._process.start()
        self._connection = ours
        if not ours.poll(STARTUP_TIMEOUT):
            self.close()
            return f"the reward worker did not start within {STARTUP_TIMEOUT} s"
        status, value = ours.recv()
        if status != "ready":
            self.close()
            return value
        return None

    def close(self) -> None:
        """Stop the worker (a hung one is killed)."""
        if self._process is None:
            return
        if self._process.is_alive():
            self._process.kill()
        self._process.join(timeout=5)
        self._process, self._connection = None, None


def _checked(value, count: int) -> CallResult:
    if not isinstance(value, (list, tuple)) or len(value) != count:
        shown = (
            f"{type(value).__name__} of length {len(value)}"
            if hasattr(value, "__len__")
            else type(value).__name__
        )
        return CallResult(None, f"returned {shown}; expected a list of {count} numbers")
    rewards: list[float | None] = []
    for item in value:
        if item is None:
            rewards.append(None)
            continue
        try:
            number = float(item)
        except (TypeError, ValueError):
            return CallResult(None, f"returned {item!r}, not a number")
        if not math.isfinite(number):
            return CallResult(None, f"returned {number}, not a finite number")
        rewards.append(number)
    return CallResult(rewards)
