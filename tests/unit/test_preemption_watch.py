"""The preemption handler and the signal relay, in one process: a signal is recorded, not
acted on, until the step boundary; a second signal during the save changes nothing; the
handlers are put back afterwards; each launcher layer passes the signal down and waits."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from swiftlm.distributed.signals import (
    AGENT_GRACE_S,
    agent_grace,
    agent_signals,
    call_forwarding_signals,
)
from swiftlm.errors import Preempted
from swiftlm.train.preemption import PreemptionWatch


def one_process_job(tmp_path, logged: list):
    ctx = SimpleNamespace(distributed=False)
    strategy = SimpleNamespace(ctx=ctx)
    return SimpleNamespace(
        strategy=strategy, run_dir=tmp_path, log=logged.append, checkpoint_tiers=None
    )


def test_no_signal_no_stop(tmp_path):
    watch = PreemptionWatch(SimpleNamespace(distributed=False)).install()
    try:
        saves = []
        watch.stop_if_signalled(one_process_job(tmp_path, []), 3, False, lambda: saves.append(1))
        assert saves == []
    finally:
        watch.restore()


def test_second_signal_during_the_save_is_ignored_and_handlers_come_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    logged, saves = [], []
    job = one_process_job(tmp_path, logged)
    watch = PreemptionWatch(job.strategy.ctx).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning: recorded only
        assert watch.received == signal.SIGUSR1

        def save() -> None:  # the scheduler insists while the checkpoint is written
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
            saves.append("written")

        with pytest.raises(Preempted) as stop:
            watch.stop_if_signalled(job, 7, saved=False, save=save)
    finally:
        watch.restore()
    assert saves == ["written"]  # once, whole: this process was not stopped by SIGTERM
    assert stop.value.exit_code == 99 and stop.value.signal_name == "SIGUSR1"
    expected = (
        f"preempted by SIGUSR1 at step 7: saved checkpoint {tmp_path / 'checkpoints' / 'step-7'}"
        "; resume with --resume_from_checkpoint auto"
    )
    assert logged == [expected] and str(stop.value) == expected
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


def test_a_step_already_saved_is_not_saved_again(tmp_path):
    job = one_process_job(tmp_path, [])
    watch = PreemptionWatch(job.strategy.ctx).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Preempted, match="preempted by SIGTERM at step 10"):
            watch.stop_if_signalled(job, 10, saved=True, save=pytest.fail)
    finally:
        watch.restore()


def test_the_command_relays_sigterm_and_waits_for_the_child():
    """Without the relay, SIGTERM would end `swiftlm` at once and orphan torchrun."""
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(99))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    # The parent sends itself SIGTERM once the child is ready; the relay passes it on.
    parent = (
        "import os, signal, subprocess, sys, time\n"
        "from swiftlm.distributed import signals\n"
        "real = subprocess.Popen\n"
        "def popen(cmd, **kw):\n"
        "    p = real(cmd, stdout=subprocess.PIPE, text=True, **kw)\n"
        "    p.stdout.readline()\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return p\n"
        "subprocess.Popen = popen\n"
        f"sys.exit(signals.call_forwarding_signals([sys.executable, '-c', {child!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", parent], timeout=60)
    assert done.returncode == 99


def test_the_agent_handles_sigusr1_and_waits_longer_than_torchrun_does(monkeypatch):
    assert agent_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    assert agent_signals("SIGUSR1,SIGTERM") == "SIGUSR1,SIGTERM"
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert agent_grace(None) == AGENT_GRACE_S == 300
    assert agent_grace(45) == 45
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "60")
    assert agent_grace(None) is None  # torchrun reads the variable itself
    assert call_forwarding_signals([sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_the_agent_acts_on_the_first_preemption_signal_only(monkeypatch):
    """A second SIGTERM (SLURM signals every process, and the command relays it) must not
    break off the agent's wait for its saving workers; a later Ctrl-C still does."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from swiftlm.distributed.signals import stop_agent_once

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    stop_agent_once()
    stop_agent_once()  # once is enough: not wrapped twice
    handler = api._terminate_process_handler
    with pytest.raises(SignalException):
        handler(signal.SIGTERM, None)
    assert handler(signal.SIGTERM, None) is None
    assert handler(signal.SIGUSR1, None) is None
    with pytest.raises(SignalException):
        handler(signal.SIGINT, None)
