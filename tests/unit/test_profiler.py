"""`--profile` on CPU: a tiny model stepped by hand, as the loop steps it.

The trace must cover exactly the window's steps (each marked `swiftlm step N`), be valid
Chrome-trace JSON, and the operator table must list aten operators; without --profile nothing
is written; a window past the run's end or a run resumed past the window says so in the log.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from swiftlm.monitor import profiler as profiler_module
from swiftlm.monitor.profiler import StepProfiler, plan_window

CPU = torch.device("cpu")


def args(profile=True, steps="2-3"):
    return SimpleNamespace(profile=profile, profile_steps=steps)


def train(profiler: StepProfiler, steps, first_step: int = 1) -> None:
    """A few optimizer steps of a tiny model, with the profiler's calls where the loop has them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(first_step, first_step + steps):
            profiler.step_begin(step)
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step_end(step)
    finally:
        profiler.close()


def test_the_window_is_traced_and_the_top_operators_are_written(tmp_path):
    lines = []
    train(StepProfiler(args(), tmp_path, CPU, lines.append, num_steps=3), steps=3)
    folder = tmp_path / "profile"
    trace = json.loads((folder / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"swiftlm step 2", "swiftlm step 3"} <= names and "swiftlm step 1" not in names
    assert any(str(name).startswith("aten::") for name in names)
    table = (folder / "top_operators.txt").read_text()
    assert "Top 15 operators by self CPU time" in table and "aten::" in table
    assert "swiftlm step" not in table  # the step marks are not operators
    assert not (folder / "memory_snapshot.pickle").exists()  # CUDA only
    (summary,) = lines
    assert summary.startswith(f"profile of steps 2-3: {folder / 'trace.json'}")
    assert "https://ui.perfetto.dev" in summary
    # the top operator by self CPU time: an aten op, or under load autograd's AccumulateGrad
    top = summary.splitlines()[1]
    assert ("aten::" in top or "autograd::" in top) and "%" in top, top


def test_without_profile_nothing_is_written_nor_imported(tmp_path, monkeypatch):
    lines = []
    profiler = StepProfiler(args(profile=False), tmp_path, CPU, lines.append, num_steps=3)
    started = []
    monkeypatch.setattr(profiler, "_start", started.append)
    train(profiler, steps=3)
    assert not (tmp_path / "profile").exists() and lines == [] and started == []
    assert not profiler.active


@pytest.mark.parametrize(
    ("flag", "num_steps", "window", "note"),
    [
        ((5, 8), 10, (5, 8), ""),
        ((5, 8), 6, (5, 6), "--profile_steps 5-8: the run has 6 steps; profiling steps 5-6"),
        ((5, 8), 3, (3, 3), "--profile_steps 5-8: the run has 3 steps; profiling steps 3-3"),
        ((1, 1), 0, None, "--profile_steps 1-1: the run has no steps to profile"),
    ],
)
def test_plan_window_clamps_to_the_run_and_says_so(flag, num_steps, window, note):
    assert plan_window(*flag, num_steps) == (window, note)


def test_a_window_past_the_end_is_clamped_and_logged(tmp_path):
    lines = []
    train(StepProfiler(args(steps="5-8"), tmp_path, CPU, lines.append, num_steps=3), steps=3)
    assert lines[0] == "--profile_steps 5-8: the run has 3 steps; profiling steps 3-3"
    assert lines[1].startswith("profile of steps 3-3:")
    names = {
        e.get("name")
        for e in json.loads((tmp_path / "profile/trace.json").read_text())["traceEvents"]
    }
    assert "swiftlm step 3" in names and "swiftlm step 2" not in names


def test_a_run_resumed_past_the_window_logs_once_and_profiles_nothing(tmp_path):
    lines = []
    profiler = StepProfiler(args(steps="2-3"), tmp_path, CPU, lines.append, num_steps=8)
    train(profiler, steps=4, first_step=5)  # resumed at step 4: steps 5..8 remain
    assert lines == ["--profile_steps 2-3: resumed at step 5, no profile"]
    assert not (tmp_path / "profile").exists()


def test_a_run_resumed_inside_the_window_profiles_the_rest(tmp_path):
    lines = []
    profiler = StepProfiler(args(steps="2-4"), tmp_path, CPU, lines.append, num_steps=6)
    train(profiler, steps=3, first_step=3)
    assert lines[0] == "--profile_steps 2-4: resumed at step 3; profiling 3-4"
    assert lines[1].startswith("profile of steps 3-4:")


def test_a_run_that_stops_inside_the_window_still_writes_its_trace(tmp_path):
    lines = []
    profiler = StepProfiler(args(steps="1-5"), tmp_path, CPU, lines.append, num_steps=5)
    with pytest.raises(ZeroDivisionError):
        profiler.step_begin(1)
        try:
            raise ZeroDivisionError  # the step fails; the loop's finally calls close()
        finally:
            profiler.close()
    profiler.close()  # idempotent
    assert (tmp_path / "profile" / "trace.json").exists()
    assert lines[-1].startswith("profile of steps 1-1:")


def test_a_failed_export_is_logged_and_training_goes_on(tmp_path):
    lines = []
    not_a_folder = tmp_path / "run"
    not_a_folder.write_text("")  # profile/ cannot be created inside a file
    train(StepProfiler(args(steps="1-1"), not_a_folder, CPU, lines.append, num_steps=2), steps=2)
    assert len(lines) == 1 and lines[0].startswith("--profile: could not write the profile to")


def test_on_cuda_the_memory_history_is_recorded_and_dumped(tmp_path, monkeypatch):
    """The CUDA-only calls, with the CUDA functions replaced: what is called, in what order."""
    calls = []
    memory = SimpleNamespace(
        _record_memory_history=lambda *a, **k: calls.append(("history", k)),
        _dump_snapshot=lambda path: calls.append(("dump", path)),
    )
    monkeypatch.setattr(torch.cuda, "memory", memory)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync",)))
    monkeypatch.setattr(profiler_module, "_profiler_activities", lambda device: _cpu_only())
    lines = []
    cuda = torch.device("cuda", 0)
    profiler = StepProfiler(args(steps="1-1"), tmp_path, cuda, lines.append, num_steps=1)
    profiler.step_begin(1)
    profiler.step_end(1)
    snapshot = str(tmp_path / "profile" / "memory_snapshot.pickle")
    assert calls == [
        ("history", {"max_entries": profiler_module.PROFILE_HISTORY_ENTRIES, "stacks": "python"}),
        ("sync",),
        ("dump", snapshot),
        ("history", {"enabled": None}),  # off again: the OOM history was not on
    ]
    assert lines[-1] == f"memory snapshot: {snapshot} (drag it onto https://pytorch.org/memory_viz)"
    assert "by self CUDA time" in lines[0]


def _cpu_only():
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_real_gpu_the_trace_has_kernels_and_the_memory_snapshot_is_written(tmp_path):
    import pickle

    lines = []
    device = torch.device("cuda", 0)
    profiler = StepProfiler(args(steps="2-3"), tmp_path, device, lines.append, num_steps=3)
    model = torch.nn.Linear(256, 256).to(device)
    try:
        for step in (1, 2, 3):
            profiler.step_begin(step)
            model(torch.randn(64, 256, device=device)).sum().backward()
            profiler.step_end(step)
    finally:
        profiler.close()
    folder = tmp_path / "profile"
    events = json.loads((folder / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert "by self CUDA time" in (folder / "top_operators.txt").read_text()
    with (folder / "memory_snapshot.pickle").open("rb") as f:
        assert "segments" in pickle.load(f)
    assert lines[0].startswith("profile of steps 2-3:") and "memory_viz" in lines[1]
