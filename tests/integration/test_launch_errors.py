"""Errors under `swiftlm sft --nproc_per_node 2` reach the user once: the first failing rank's
message, its rank, and its exit code, without torchrun's ChildFailedError stack or the echo
of the failure on the other ranks (a gloo "Connection closed by peer" traceback).

The two launches run at once (~10 s together on 2 cores): both fail before training starts.
The reporting pieces (records, dedupe, the crash hook) are also checked in-process.
"""

import json
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from test_elastic import Launch

from conftest import CHAT_ROWS, write_jsonl
from swiftlm.distributed import failures
from swiftlm.distributed.torchrun import report_child_failure, shell_exit_code
from swiftlm.errors import ConfigError, DataError

NOISE = ("Traceback", "ChildFailedError", "[rank1]", "[rank0]", "Connection closed")


@pytest.mark.bad_input(
    input="A failure in the workers of `--nproc_per_node 2` (a bad dataset row, a flag rule "
    "checked in every worker)",
    outcome="The first failing rank's error once, with its rank, and its exit code; no "
    "torchrun ChildFailedError stack, no echo from the other rank",
)
def test_worker_errors_reach_the_user_once_with_their_exit_code(tiny_model_dir, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [*CHAT_ROWS[:6], "{not json"])
    good = write_jsonl(tmp_path / "good.jsonl", CHAT_ROWS)
    # Rank 0 reads the data while rank 1 waits for it in a broadcast.
    bad_row = Launch(
        tmp_path, "bad-row", 29561, "--model", str(tiny_model_dir), "--dataset", str(bad)
    )
    # A rule between flags is checked by every worker: both ranks raise the same ConfigError.
    flags = ["--model", str(tiny_model_dir), "--dataset", str(good)]
    bad_flag = Launch(tmp_path, "bad-flag", 29562, *flags, "--max_tokens_per_batch", "16")

    code, output = bad_row.wait()
    assert code == DataError.exit_code, output[-3000:]
    assert output.count("swiftlm sft: error:") == 1, output[-3000:]
    assert "bad.jsonl:7: invalid JSON" in output
    assert "swiftlm sft: stopped: rank 0 failed first (exit code 1)" in output
    assert not [n for n in NOISE if n in output], output[-3000:]

    code, output = bad_flag.wait()
    assert code == ConfigError.exit_code, output[-3000:]
    assert output.count("swiftlm sft: error: --max_tokens_per_batch 16") == 1, output[-3000:]
    assert "(exit code 2); the same error on rank " in output, output[-3000:]
    assert not [n for n in NOISE if n in output], output[-3000:]


def in_worker(monkeypatch, tmp_path, rank: int) -> None:
    """This process as rank `rank` of swiftlm's launcher, first attempt."""
    monkeypatch.setenv(failures.FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")


def child_failed(*failed: tuple[int, int, int]) -> SimpleNamespace:
    """What report_child_failure reads of torchrun's ChildFailedError: rank -> (pid, exitcode)."""
    processes = {rank: SimpleNamespace(pid=pid, exitcode=code) for rank, pid, code in failed}
    first = min(processes)
    return SimpleNamespace(failures=processes, get_first_failure=lambda: (first, processes[first]))


def test_a_worker_records_its_error_and_the_launcher_prints_the_first_once(
    monkeypatch, tmp_path, capsys
):
    for rank in (1, 0):  # rank 1 fails first
        in_worker(monkeypatch, tmp_path, rank)
        failures.report_error("sft", ConfigError("bad flag"))
    assert capsys.readouterr().err == ""  # the workers print nothing themselves
    records = failures.read_failures(tmp_path)
    pid = records[0].pid  # both records come from this one process here
    assert report_child_failure("swiftlm sft", child_failed((0, pid, 2)), tmp_path) == 2
    assert capsys.readouterr().err.splitlines() == [
        "swiftlm sft: error: bad flag",
        "swiftlm sft: stopped: rank 1 failed first (exit code 2); the same error on rank 0",
    ]


def test_records_of_an_earlier_attempt_are_not_reported(tmp_path, capsys):
    """--max_restarts: only the processes of torchrun's last attempt count (matched by pid)."""
    stale = failures.Failure(
        rank=0, pid=123, attempt=0, time=1.0, exit_code=2, text="error: old", printed=False
    )
    (tmp_path / "attempt-0-rank-0.json").write_text(json.dumps(asdict(stale)))
    assert report_child_failure("swiftlm sft", child_failed((1, 456, -9)), tmp_path) == 137
    assert capsys.readouterr().err == (
        "swiftlm sft: stopped: rank 1 failed first (killed by SIGKILL, exit code 137); "
        "its output is above\n"
    )
    assert shell_exit_code(124) == 124


def test_a_crash_after_another_ranks_failure_is_not_printed(monkeypatch, tmp_path, capsys):
    in_worker(monkeypatch, tmp_path, 0)
    failures.report_error("sft", DataError("data.jsonl:3: bad row"))
    in_worker(monkeypatch, tmp_path, 1)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    failures.install_crash_hook()
    echo = RuntimeError("Connection closed by peer")
    sys.excepthook(RuntimeError, echo, None)  # rank 1's collective after rank 0 exited
    assert capsys.readouterr().err == ""
    assert [f.rank for f in failures.read_failures(tmp_path)] == [0]


def test_the_first_crash_is_printed_and_recorded(monkeypatch, tmp_path, capsys):
    in_worker(monkeypatch, tmp_path, 1)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    failures.install_crash_hook()
    sys.excepthook(KeyError, KeyError("q_proj"), None)
    assert "KeyError: 'q_proj'" in capsys.readouterr().err
    [record] = failures.read_failures(tmp_path)
    assert (record.rank, record.text, record.printed) == (1, "KeyError: 'q_proj'", True)


def test_outside_swiftlms_launcher_a_worker_prints_its_error(monkeypatch, capsys):
    monkeypatch.delenv(failures.FAILURE_DIR_ENV, raising=False)
    failures.report_error("sft", ConfigError("bad flag"))
    assert capsys.readouterr().err == "swiftlm sft: error: bad flag\n"
