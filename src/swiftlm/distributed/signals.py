"""Preemption signals on their way from the scheduler to the workers of a launched run.

`swiftlm sft --nproc_per_node N` is three layers of processes: the `swiftlm` command, the
torchrun agent it starts, and the workers. A scheduler may signal only the first
(Kubernetes signals the container's main process) or all of them (SLURM). Each layer passes
SIGTERM and SIGUSR1 down and waits, so the workers save a checkpoint at their next step
boundary (`train.preemption`) and the run exits with the preemption status (99):

- the `swiftlm` command forwards them to the agent (`call_forwarding_signals`);
- the agent, told to handle SIGUSR1 as well as SIGTERM (`agent_signals`), sends the same
  signal to every worker and waits `AGENT_GRACE_S` for them before it kills them (torchrun's
  own default is 30 s, short for saving a large model; TORCH_ELASTIC_SHUTDOWN_TIMEOUT or
  torchrun's --shutdown_timeout sets another). No torch import here: the `swiftlm` command
  only re-executes itself.
"""

import os
import signal
import subprocess
import threading

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 99  # errors.Preempted.exit_code, said here without importing it
AGENT_GRACE_S = 300


def call_forwarding_signals(cmd: list[str], env: dict | None = None) -> int:
    """`subprocess.call(cmd)`, passing SIGTERM and SIGUSR1 on to the child and waiting for it
    (without this, SIGTERM would end this process at once and leave the child running). A
    signal that arrives while the child is being started is passed on once it runs."""
    child: list[subprocess.Popen] = []
    early: list[int] = []

    def forward(signum: int, frame) -> None:
        if not child:
            early.append(signum)
        elif child[0].poll() is None:
            child[0].send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in PREEMPTION_SIGNALS}
    try:
        child.append(subprocess.Popen(cmd, env=env))
        for signum in early:
            child[0].send_signal(signum)
        return child[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_agent_once() -> None:
    """Make the torchrun agent act on the first SIGTERM/SIGUSR1 only.

    SLURM signals every process of the job, and the `swiftlm` command relays the signal too,
    so the agent may get it twice. torch's handler raises on each one; a second raise would
    break off the agent's wait for its saving workers and end it early (in a container, the
    end of the main process kills the workers mid-save). Later SIGINTs still interrupt.
    """
    from torch.distributed.elastic.multiprocessing import api

    original = api._terminate_process_handler
    if getattr(original, "once", False):
        return
    stopping: list[int] = []

    def handler(signum: int, frame) -> None:
        if stopping and signum in PREEMPTION_SIGNALS:
            return  # already shutting down: the workers are saving
        stopping.append(signum)
        original(signum, frame)

    handler.once = True
    # torch looks the handler up by this name each time it starts workers
    api._terminate_process_handler = handler


def agent_signals(handled: str) -> str:
    """torchrun's --signals_to_handle with SIGUSR1 added: SLURM's warning signal (by default
    SIGUSR1 would end the agent and orphan its workers)."""
    names = [name.strip() for name in handled.split(",") if name.strip()]
    return ",".join([*names, *(s.name for s in PREEMPTION_SIGNALS if s.name not in names)])


def agent_grace(shutdown_timeout: int | None) -> int | None:
    """How long the agent waits for signalled workers: torchrun's setting when one is given,
    else `AGENT_GRACE_S`."""
    if shutdown_timeout is not None or "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ:
        return shutdown_timeout
    return AGENT_GRACE_S
