"""Multi-rank runs started by in-process tests fork their workers from a warm process.

`main([... "--nproc_per_node", "2"])` normally runs torchrun in a subprocess whose agent
starts each worker as a fresh `python -m swiftlm`: on a 2-core machine each of those
interpreters spends ~10 s of CPU importing torch, transformers, peft (and what they import:
bitsandbytes, torchao, scipy, accelerate), more than most tests' training takes.

Under pytest, such a call runs the same agent in the test process instead:
`swiftlm.distributed.torchrun.main` with its failure reports and notices, and torch's elastic
agent with its rendezvous, per-rank environment, monitoring, restarts and shutdown. Only the
way a worker process comes to exist differs: the agent forks it from a forkserver that
imported those libraries once for the whole session, and the worker runs
`swiftlm.cli.main.main(argv)` as `python -m swiftlm` would. It gets what a torchrun worker
gets: the launcher's environment plus the agent's per-rank variables, the launcher's working
directory, the test's stdout and stderr, and its exit code goes back to the agent.

What this leaves out (the `swiftlm` command re-executing itself under torchrun in a
subprocess, signal forwarding between the three layers, a worker's fresh interpreter) is
covered by the tests that run the `swiftlm` command as a subprocess (test_launch_errors,
test_elastic, test_elastic_membership, test_preemption_ddp, test_run_dirs_torchrun, ...) and
by tests marked `torchrun_subprocess`, which keep the real path.
"""

import contextlib
import logging
import multiprocessing
import os
import runpy
import signal
import sys
from multiprocessing import forkserver, reduction

# What a training worker imports before its first step (the slow part of its start-up). A
# module that is not installed is skipped by the forkserver.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "peft",
    "safetensors.torch",
    "swiftlm.cli.main",
    "swiftlm.train.run",
]

AGENT_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)

_forkserver_env: dict[str, str] | None = None


def forkserver_environment() -> dict[str, str]:
    """Start the session's forkserver once; the environment it (and so every fork) has."""
    global _forkserver_env
    if _forkserver_env is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        _forkserver_env = dict(os.environ)
        forkserver.ensure_running()
    return _forkserver_env


class InheritedFd:
    """A file descriptor of the launching process, passed to a forked worker when it is
    started (multiprocessing's DupFd): the worker writes to the same open file, so pytest's
    capture of the test sees the worker's output as it sees a subprocess's."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup_fd) -> int:
    return dup_fd.detach()


def warm_worker(launcher_env: dict, forkserver_env: dict, stdout: int, stderr: int, python_args):
    """A worker's life in a forked process: `python -u <python_args>` without the imports
    (`-m module args...` or `script.py args...`)."""
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    # The agent set its per-rank variables (RANK, LOCAL_RANK, MASTER_PORT, ...) in this
    # process's environment, which is otherwise the forkserver's: a torchrun worker has the
    # launcher's environment with those on top.
    per_rank = {k: v for k, v in os.environ.items() if forkserver_env.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(per_rank)
    import torch

    if os.environ.get("OMP_NUM_THREADS"):  # read by a fresh interpreter when torch loads
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if python_args[0] == "-m":
        sys.argv = [python_args[1], *python_args[2:]]
        runpy.run_module(python_args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(python_args)
        runpy.run_path(python_args[0], run_name="__main__")


def warm_run(args) -> None:
    """torch.distributed.run.run with the workers forked warm (a launch of `-m module` or of
    a script, with the Python interpreter)."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    config, cmd, cmd_args = config_from_args(args)
    assert cmd == sys.executable and cmd_args[0] == "-u", (cmd, cmd_args)
    config.start_method = "forkserver"
    fork_env = forkserver_environment()
    launcher_env = dict(os.environ)  # what torchrun's subprocess workers would inherit
    elastic_launch(config=config, entrypoint=warm_worker)(
        launcher_env, fork_env, InheritedFd(1), InheritedFd(2), tuple(cmd_args[1:])
    )


def torchrun_script(torchrun_args: list[str], env: dict | None = None) -> None:
    """`torchrun <torchrun_args>` (a script or `-m module` and its arguments last) with
    environment `env` (default: this process's), its agent in this process and its workers
    forked warm. Raises torch's ChildFailedError if a worker fails."""
    from torch.distributed.run import parse_args

    with agent_in_this_process(env):
        warm_run(parse_args(torchrun_args))


@contextlib.contextmanager
def environment(env: dict):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def agent_in_this_process(env: dict | None):
    """The agent runs with environment `env` (default: this process's), as a subprocess
    agent would, and what it changes in this process is undone afterwards."""
    with environment(env if env is not None else dict(os.environ)), agent_state_restored():
        yield


@contextlib.contextmanager
def agent_state_restored():
    """The agent installs signal handlers (SIGINT, SIGTERM, ... raise in the main thread) and
    swiftlm's torchrun.main adds log filters; a subprocess agent drops them when it exits, the
    test process must put them back."""
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1]
    handlers = {sig: signal.getsignal(sig) for sig in signals}
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    kept = [(log, list(log.filters), log.level) for log in loggers]
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for log, filters, level in kept:
            log.filters[:] = filters
            log.setLevel(level)


def in_process_agent(cmd: list[str], env: dict | None = None) -> int:
    """Stands in for `call_forwarding_signals(cmd, env)` in swiftlm.distributed.launch: runs
    `python -m swiftlm.distributed.torchrun <args>` as a call, in this process."""
    import torch.distributed.run

    from swiftlm.distributed import torchrun

    assert cmd[:3] == [sys.executable, "-m", "swiftlm.distributed.torchrun"], cmd
    original = torch.distributed.run.run
    torch.distributed.run.run = warm_run
    try:
        with agent_in_this_process(env):
            return torchrun.main(cmd[3:])
    finally:
        torch.distributed.run.run = original
