"""The heartbeat watchdog's timing, blame logic and stack dumps on a fake clock: no processes,
no threads (except one test that checks the real thread ends a single process).

`Ranks` builds one `Heartbeat` per rank sharing a tmp run directory, as the processes of a job
share one; `tick()` is what each rank's watchdog thread does every second.
"""

import json
import threading

import pytest

from swiftlm.distributed import heartbeat as hb
from swiftlm.distributed.env import DistContext

TIMEOUT = 8.0


class FakeContext:
    """The part of DistContext the heartbeat uses; the broadcast returns rank 0's token."""

    def __init__(self, rank: int, world_size: int, token: str = "run-1"):
        self.rank, self.world_size, self.token = rank, world_size, token

    def broadcast_object(self, value):
        return self.token


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ranks:
    """The watchdogs of a job on one fake clock; exit codes and messages are recorded."""

    def __init__(self, run_dir, world_size=2):
        self.clock, self.exits, self.messages = FakeClock(), [], []
        self.hbs = [
            hb.Heartbeat(
                FakeContext(rank, world_size),
                TIMEOUT,
                run_dir,
                clock=self.clock,
                wall=self.clock,
                exit_fn=self.exits.append,
                report=self.messages.append,
            )
            for rank in range(world_size)
        ]
        for h in self.hbs:
            h.token = "run-1"  # what start() would broadcast; start() itself spawns a thread
            h.beat(0, "setup")

    def advance(self, seconds: float, ticking=(0, 1)) -> list[str]:
        """Move time on one second at a time; the ranks in `ticking` (alive) tick each second."""
        found = []
        for _ in range(int(seconds)):
            self.clock.now += 1.0
            found += [self.hbs[r].tick() for r in ticking]
        return [m for m in found if m]

    def beat(self, step: int, phase: str, ranks=(0, 1)) -> None:
        for r in ranks:
            self.hbs[r].beat(step, phase)


@pytest.fixture
def ranks(tmp_path):
    return Ranks(tmp_path)


def test_ranks_that_keep_beating_are_never_stopped(ranks):
    for step in range(1, 31):  # 30 s, far past the timeout, with a beat every second
        ranks.beat(step, "forward/backward")
        assert ranks.advance(1) == []
    assert ranks.exits == []


def test_every_watchdog_fires_one_tick_after_the_timeout_and_blames_the_stuck_rank(ranks):
    ranks.advance(3)
    ranks.beat(3, "forward/backward")
    ranks.beat(3, "optimizer step", ranks=(0,))  # rank 0 goes on; rank 1 hangs in forward
    hang_at = ranks.clock.now
    assert ranks.advance(TIMEOUT) == []
    found = ranks.advance(1)
    assert ranks.clock.now - hang_at == TIMEOUT + 1
    assert ranks.exits == [hb.HEARTBEAT_EXIT_CODE] * 2
    assert all("rank 1 made no progress for 9.0 s" in m for m in found)
    assert all("(last: step 3, phase forward/backward;" in m for m in found)
    assert "(watchdog of rank 0)" in found[0] and "(watchdog of rank 1)" in found[1]
    assert "raise --heartbeat_timeout" in found[0]


def test_the_blamed_rank_is_the_one_not_waiting_in_a_collective(ranks, monkeypatch):
    # Both ranks beat "forward/backward" together; rank 1 then hangs in its own code while
    # rank 0 waits for it inside a collective: their beat ages alone cannot tell them apart.
    where = {
        0: ("torch/distributed/distributed_c10d.py:2 in all_reduce", "collective"),
        1: ("train/losses.py:9 in causal_lm_loss", "running"),
    }
    for rank, h in enumerate(ranks.hbs):
        monkeypatch.setattr(h, "_record", _located(h._record, *where[rank]))
    ranks.beat(3, "forward/backward")
    found = ranks.advance(TIMEOUT + 1)
    assert len(found) == 2 and all(m.startswith("swiftlm: rank 1 made no progress") for m in found)
    assert "now at train/losses.py:9 in causal_lm_loss)" in found[0]


def test_a_rank_behind_in_the_loop_is_blamed_even_if_it_beat_last(ranks):
    ranks.beat(3, "forward/backward", ranks=(0,))
    ranks.beat(3, "optimizer step", ranks=(0,))  # rank 0 is one phase ahead ...
    ranks.advance(1)
    ranks.beat(3, "forward/backward", ranks=(1,))  # ... although rank 1 beat a second later
    found = ranks.advance(TIMEOUT + 2)
    assert found[0].startswith("swiftlm: rank 1 made no progress")


def test_a_killed_rank_is_blamed_and_reported_as_dead(ranks):
    ranks.beat(2, "checkpoint save")
    ranks.advance(2)
    ranks.beat(3, "forward/backward", ranks=(0,))
    # Rank 1 is killed now: its file stays as it was. Rank 0 blocks at its next collective.
    found = ranks.advance(TIMEOUT + 1, ticking=(0,))
    assert ranks.exits == [hb.HEARTBEAT_EXIT_CODE]
    assert "rank 1 made no progress for 11.0 s (last: step 2, phase checkpoint save;" in found[0]
    assert "its heartbeat stopped 9.0 s ago: the process died or froze" in found[0]


def test_a_rank_that_progresses_does_not_stop_for_another(ranks):
    # Each watchdog acts on its own rank's progress: in lockstep training a stuck rank stalls
    # everyone at the next collective, and without collectives nobody is waiting for it.
    for step in range(1, 21):
        ranks.beat(step, "forward/backward", ranks=(0,))
        assert ranks.advance(1, ticking=(0,)) == []


def test_leftover_files_of_an_earlier_attempt_are_never_blamed(tmp_path):
    leftover = {"token": "run-0", "seq": 0, "step": 1, "phase": "setup", "written": 0.0}
    hb.write_atomically(hb.rank_file(tmp_path, 1), leftover)
    ranks = Ranks(tmp_path)
    ranks.advance(2, ticking=(0,))
    ranks.beat(4, "forward/backward", ranks=(0,))
    found = ranks.advance(TIMEOUT + 1, ticking=(0,))
    assert found[0].startswith("swiftlm: rank 0 made no progress")


def test_stop_removes_the_files_and_the_folder(ranks, tmp_path):
    ranks.advance(1)
    names = sorted(p.name for p in (tmp_path / ".heartbeat").iterdir())
    assert names == ["rank-0.json", "rank-1.json"]
    for h in ranks.hbs:
        h.stop()
    assert not (tmp_path / ".heartbeat").exists()


def test_a_zero_timeout_disables_everything(tmp_path):
    h = hb.Heartbeat(FakeContext(0, 2), 0, tmp_path, exit_fn=pytest.fail)
    h.start()
    h.beat(1, "forward/backward")
    h.stop()
    assert h._thread is None and not (tmp_path / ".heartbeat").exists()


def test_the_record_holds_the_step_phase_age_and_token(ranks, tmp_path):
    ranks.beat(4, "optimizer step", ranks=(0,))
    ranks.clock.now += 2.5
    ranks.hbs[0].tick()
    record = json.loads((tmp_path / ".heartbeat" / "rank-0.json").read_text())
    assert (record["step"], record["phase"], record["token"]) == (4, "optimizer step", "run-1")
    assert record["age_s"] == pytest.approx(2.5) and record["written"] == ranks.clock.now


def test_a_disk_error_is_reported_once_and_training_goes_on(tmp_path):
    not_a_folder = tmp_path / "run"
    not_a_folder.write_text("")  # .heartbeat cannot be created inside a file
    messages = []
    h = hb.Heartbeat(FakeContext(0, 2), TIMEOUT, not_a_folder, report=messages.append)
    h.beat(1, "forward/backward")
    assert h.tick() is None and h.tick() is None
    assert len(messages) == 1 and "rank 0 cannot write its heartbeat" in messages[0]


def test_a_state_age_is_the_time_since_written_plus_the_beat_age_at_writing():
    states = hb.rank_states({3: {"written": 10.0, "age_s": 3.0}}, wall_now=15.0)
    assert states[3].silent_s == pytest.approx(5.0) and states[3].age_s == pytest.approx(8.0)


@pytest.mark.parametrize(
    ("filename", "activity"),
    [
        ("/venv/lib/site-packages/torch/distributed/distributed_c10d.py", "collective"),
        ("/venv/lib/site-packages/torch/nn/parallel/distributed.py", "collective"),
        ("/venv/lib/site-packages/torch/autograd/graph.py", "backward"),
        ("/work/src/swiftlm/train/losses.py", "running"),
    ],
)
def test_classify_tells_waiting_from_running(filename, activity):
    assert hb.classify(filename) == activity


def test_locate_thread_finds_a_blocked_threads_frame():
    release, started = threading.Event(), threading.Event()

    def parked():
        started.set()
        release.wait()

    thread = threading.Thread(target=parked)
    thread.start()
    started.wait()
    try:
        where, activity = hb.locate_thread(thread.ident)
    finally:
        release.set()
        thread.join()
    assert "threading.py" in where and " in wait" in where and activity == "running"
    assert hb.locate_thread(None) == ("unknown", "running")


def test_the_watchdog_thread_really_stops_a_single_process_and_dumps_its_stacks(tmp_path):
    """A plain `swiftlm sft`: the real DistContext of one process, no process group."""
    exited, codes = threading.Event(), []

    def fake_exit(code):
        codes.append(code)
        exited.set()

    h = hb.Heartbeat(
        DistContext(), 0.3, tmp_path, interval_s=0.05, exit_fn=fake_exit, report=codes.append
    )
    h.start()  # and no beat after it: the loop (this test's thread) is stuck
    try:
        assert exited.wait(timeout=5)
    finally:
        h.stop()
    message, code = codes
    assert code == hb.HEARTBEAT_EXIT_CODE
    assert message.startswith("swiftlm: no training progress for ")
    assert "(last: step 0, phase setup; main thread now at " in message and " in wait)" in message
    stacks = tmp_path / "hang" / "rank-0-stacks.txt"
    assert f"Python stacks of every thread: {stacks}" in message
    text = stacks.read_text()
    # The stuck loop first, named, down to the line that waits; then faulthandler's view.
    loop = text.index(" - the training loop, most recent call last:")
    assert text.index("in test_the_watchdog_thread_really_stops_a_single_process", loop) > loop
    assert 'Thread "swiftlm-heartbeat"' in text and "this watchdog" in text
    assert "--- faulthandler: the same threads" in text and "most recent call first" in text


def test_one_process_names_the_step_phase_place_and_stacks_file(tmp_path):
    clock, codes, messages = FakeClock(), [], []
    h = hb.Heartbeat(
        DistContext(), TIMEOUT, tmp_path, clock=clock, wall=clock, exit_fn=codes.append,
        report=messages.append,
    )  # fmt: skip
    h.token, h._main_ident = "run-1", threading.get_ident()  # what start() sets
    h.beat(2, "forward/backward")
    clock.now += TIMEOUT
    assert h.tick() is None and codes == []
    clock.now += 1
    message = h.tick()
    assert codes == [hb.HEARTBEAT_EXIT_CODE] and messages == [message]
    assert message.startswith(
        "swiftlm: no training progress for 9.0 s (last: step 2, phase forward/backward; "
        "main thread now at "
    )
    # This test's thread is the "loop" and runs tick() itself: its innermost frame is there.
    assert "heartbeat.py:" in message and "rank" not in message.split("Python stacks")[0]
    assert "raise --heartbeat_timeout (0 disables the watchdog)" in message
    stacks = tmp_path / "hang" / "rank-0-stacks.txt"
    assert message.endswith(f"Python stacks of every thread: {stacks}\n")
    header = stacks.read_text().splitlines()[0]
    assert header.startswith("swiftlm watchdog of rank 0 (pid ")
    assert "no progress for 9.0 s (last: step 2, phase forward/backward; main thread at " in header


def test_every_rank_dumps_its_own_stacks_and_names_the_stuck_ranks_file(ranks, tmp_path):
    ranks.beat(3, "forward/backward")
    ranks.beat(3, "optimizer step", ranks=(0,))  # rank 1 hangs in forward
    found = ranks.advance(TIMEOUT + 1)
    hang = tmp_path / "hang"
    assert sorted(p.name for p in hang.iterdir()) == ["rank-0-stacks.txt", "rank-1-stacks.txt"]
    assert found[0].endswith(
        f"Python stacks of every thread: rank 1's in {hang / 'rank-1-stacks.txt'} (written by "
        f"its own watchdog, if the process is alive), rank 0's in {hang / 'rank-0-stacks.txt'}.\n"
    )
    assert found[1].endswith(f"rank 1's in {hang / 'rank-1-stacks.txt'}.\n")


def test_stacks_that_cannot_be_written_go_to_stderr_and_the_process_still_stops(tmp_path, capfd):
    (tmp_path / "hang").write_text("")  # hang/ cannot be created: a file is in the way
    clock, codes, messages = FakeClock(), [], []
    h = hb.Heartbeat(
        DistContext(), TIMEOUT, tmp_path, clock=clock, wall=clock, exit_fn=codes.append,
        report=messages.append,
    )  # fmt: skip
    clock.now += TIMEOUT + 1
    h.tick()
    assert codes == [hb.HEARTBEAT_EXIT_CODE]
    assert messages[0].startswith("swiftlm: cannot write the stacks to ")
    assert "Python stacks of every thread: they could not be written (see above)" in messages[1]
    assert "most recent call first" in capfd.readouterr().err


def _located(record_fn, where, activity):
    def record():
        return {**record_fn(), "where": where, "activity": activity}

    return record
