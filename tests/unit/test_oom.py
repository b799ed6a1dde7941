"""The out-of-memory summary and guard on CPU: a synthetic allocator snapshot (the structure of
`torch.cuda.memory._snapshot()`), a real `torch.OutOfMemoryError` raised by hand, and the CUDA
calls replaced by fakes."""

import pickle
from types import SimpleNamespace

import pytest
import torch

from swiftlm.errors import SwiftLMError
from swiftlm.monitor import oom
from swiftlm.monitor.oom import DeviceOutOfMemoryError, oom_guard, summarize_oom

GIB = 1024**3
MIB = 1024**2
ERROR = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
    "of which 1.50 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch"
)


def block(size, state="active_allocated", frames=None):
    return {"size": size, "requested_size": size, "address": 0, "state": state, "frames": frames}


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


LOGITS_FRAMES = [
    frame("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 3000, "linear"),
    frame(
        "/venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py",
        500,
        "forward",
    ),
    frame("/work/src/swiftlm/losses/causal_lm.py", 42, "causal_lm_loss"),
]


def snapshot(free_block=MIB):
    """Two segments: 6 GiB of logits and 1 GiB of weights live, and some cache left free."""
    return {
        "segments": [
            {
                "total_size": 6 * GIB + free_block,
                "blocks": [block(6 * GIB, frames=LOGITS_FRAMES), block(free_block, "inactive")],
            },
            {"total_size": GIB, "blocks": [block(GIB)]},
        ],
        "device_traces": [[]],
    }


def test_the_summary_names_the_memory_the_largest_blocks_and_what_to_change():
    stats = {"allocated": 7 * GIB, "reserved": 7 * GIB + MIB, "peak": 9 * GIB, "total": 80 * GIB}
    text = summarize_oom(snapshot(), stats, ERROR)
    assert "torch: CUDA out of memory. Tried to allocate 2.00 GiB." in text
    for line in (
        "allocated by tensors: 7.00 GiB",
        "reserved by the cache: 7.00 GiB",
        "peak allocated this run: 9.00 GiB",
        "device total: 80.00 GiB",
        "the failed allocation asked for: 2.00 GiB",
        "largest live blocks (2 of 2):",
    ):
        assert line in text, text
    assert "): low" in text
    # Largest first; the code that allocated it, torch's own frames left out.
    logits = text.index("  6.00 GiB\n      ")
    assert text.index("      /venv/lib/python3.12/site-packages/transformers") > logits
    assert "functional.py" not in text
    assert "causal_lm.py:42 in causal_lm_loss" in text
    assert text.index("  6.00 GiB") < text.index("  1.00 GiB")
    steps = text[text.index("What to change") :].splitlines()[1:]
    assert steps[0].startswith("  1. lower --per_device_train_batch_size")
    assert "--per_device_train_batch_size auto" in steps[0]
    assert "--gradient_checkpointing true" in steps[1] and "--train_type lora" in steps[2]
    assert "--torch_dtype bfloat16" in steps[3] and "fsdp2" in steps[4] and "zero3" in steps[4]
    assert "--sequence_parallel_size N" in steps[5]
    assert steps[6].startswith("  7. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def test_high_fragmentation_puts_expandable_segments_first():
    # 3 GiB cached but free, in pieces of at most 1 GiB: the 2 GiB request fits in none.
    snap = snapshot(free_block=GIB)
    snap["segments"].append({"total_size": 2 * GIB, "blocks": [block(GIB, "inactive")] * 2})
    text = summarize_oom(snap, {}, ERROR)  # allocated and reserved from the snapshot itself
    assert "allocated by tensors: 7.00 GiB" in text and "reserved by the cache: 10.00 GiB" in text
    assert "fragmentation (reserved - allocated): 3.00 GiB (30% of reserved, 3 segments" in text
    assert "largest free block 1.00 GiB): high" in text
    assert "  1. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text


def test_a_free_block_big_enough_is_not_fragmentation():
    assert not oom.is_fragmented(3 * GIB, 10 * GIB, largest_free=3 * GIB, requested=2 * GIB)
    assert oom.is_fragmented(3 * GIB, 10 * GIB, largest_free=GIB, requested=2 * GIB)
    assert not oom.is_fragmented(GIB // 2, 10 * GIB, largest_free=0, requested=2 * GIB)


def test_the_summary_reads_the_plain_segment_list_and_says_when_stacks_are_missing():
    segments = [{"total_size": GIB, "blocks": [block(GIB)]}]  # torch.cuda.memory_snapshot()
    text = summarize_oom(segments, {}, "")
    assert "allocated by tensors: 1.00 GiB" in text
    assert "(no stacks: allocation history was not recording" in text
    assert "torch:" not in text and "asked for" not in text


@pytest.mark.parametrize(
    ("text", "size"),
    [(ERROR, 2 * GIB), ("Tried to allocate 20.00 MiB", 20 * MIB), ("out of memory", None)],
)
def test_requested_bytes_reads_torchs_message(text, size):
    assert oom.requested_bytes(text) == size


@pytest.fixture
def fake_cuda(monkeypatch):
    """The guard's CUDA calls replaced: the snapshot above and fixed statistics."""
    stats = {"allocated": 7 * GIB, "reserved": 7 * GIB + MIB, "peak": 9 * GIB, "total": 80 * GIB}
    monkeypatch.setattr(oom, "take_snapshot", lambda device: snapshot())
    monkeypatch.setattr(oom, "memory_stats", lambda device: stats)


def test_the_guard_writes_the_snapshot_and_summary_and_raises_a_clear_error(tmp_path, fake_cuda):
    lines = []
    original = torch.OutOfMemoryError(ERROR)
    with (
        pytest.raises(DeviceOutOfMemoryError) as caught,
        oom_guard(tmp_path, torch.device("cuda", 0), lines.append),
    ):
        raise original
    summary = tmp_path / "oom" / "summary.txt"
    assert isinstance(caught.value, SwiftLMError) and caught.value.__cause__ is original
    message = str(caught.value)
    assert message.startswith("the GPU ran out of memory while allocating 2.00 GiB.")
    assert f"What used the memory and what to change: {summary}" in message
    assert "https://pytorch.org/memory_viz" in message and "--gradient_checkpointing" in message
    with (tmp_path / "oom" / "memory_snapshot.pickle").open("rb") as f:
        assert pickle.load(f) == snapshot()
    assert "largest live blocks" in summary.read_text() and lines == [summary.read_text()]


def test_the_guard_lets_other_errors_and_success_through(tmp_path, fake_cuda):
    with oom_guard(tmp_path, torch.device("cuda", 0), print):
        pass
    with pytest.raises(ValueError), oom_guard(tmp_path, torch.device("cuda", 0), print):
        raise ValueError("not memory")
    assert not (tmp_path / "oom").exists()


def test_a_failing_snapshot_still_raises_the_out_of_memory_error(tmp_path, monkeypatch):
    def broken(device):
        raise RuntimeError("allocator busy")

    monkeypatch.setattr(oom, "take_snapshot", broken)
    lines = []
    with (
        pytest.raises(DeviceOutOfMemoryError, match="could not be written"),
        oom_guard(tmp_path, torch.device("cuda", 0), lines.append),
    ):
        raise torch.OutOfMemoryError(ERROR)
    assert lines[0].startswith("could not write the out-of-memory summary to")
    assert "allocator busy" in lines[0]


def test_on_cpu_the_guard_writes_a_summary_without_a_snapshot(tmp_path):
    with (
        pytest.raises(DeviceOutOfMemoryError),
        oom_guard(tmp_path, torch.device("cpu"), lambda line: None),
    ):
        raise torch.OutOfMemoryError("out of memory")
    assert (tmp_path / "oom" / "summary.txt").exists()
    assert not (tmp_path / "oom" / "memory_snapshot.pickle").exists()


def test_start_oom_history_is_a_no_op_on_cpu_and_records_python_stacks_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(
        torch.cuda,
        "memory",
        SimpleNamespace(_record_memory_history=lambda **k: calls.append(k)),
    )
    monkeypatch.setitem(oom._history, "on", False)
    oom.start_oom_history(torch.device("cpu"))
    assert calls == [] and not oom.oom_history_on()
    oom.start_oom_history(torch.device("cuda", 0))
    assert calls == [
        {
            "enabled": "all",
            "context": "alloc",
            "stacks": "python",
            "max_entries": oom.OOM_HISTORY_ENTRIES,
        }
    ]
    assert oom.oom_history_on()
    oom.stop_oom_history(torch.device("cuda", 0))
    assert calls[-1] == {"enabled": None} and not oom.oom_history_on()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_real_gpu_an_oom_is_summarized_with_the_allocating_code(tmp_path):
    device = torch.device("cuda", 0)
    oom.start_oom_history(device)
    try:
        held = torch.empty(GIB, dtype=torch.uint8, device=device)  # noqa: F841 - a live block
        total = torch.cuda.get_device_properties(device).total_memory
        with pytest.raises(DeviceOutOfMemoryError), oom_guard(tmp_path, device, print):
            torch.empty(2 * total, dtype=torch.uint8, device=device)
    finally:
        oom.stop_oom_history(device)
    text = (tmp_path / "oom" / "summary.txt").read_text()
    assert "  1.00 GiB" in text and "test_oom.py" in text  # the block and the line that made it
    with (tmp_path / "oom" / "memory_snapshot.pickle").open("rb") as f:
        assert pickle.load(f)["segments"]
