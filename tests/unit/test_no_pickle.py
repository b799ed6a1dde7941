"""No load path of swiftlm runs pickle: a crafted file whose unpickling would write a marker
file is put where each loader reads, and the loader refuses it (CheckpointError naming the
file) without the marker appearing. Plus a source scan, so a new `torch.load` or unpickler
cannot slip in unnoticed."""

import io
import json
import re
import tokenize
from pathlib import Path

import pytest
import torch

from swiftlm.checkpoint import load_method_state
from swiftlm.checkpoint.save import RANK_STATE_DIR
from swiftlm.checkpoint.sharded import check_tensors_only
from swiftlm.checkpoint.tree_state import load_tree, save_tree
from swiftlm.errors import CheckpointError

SRC = Path(__file__).resolve().parents[2] / "src" / "swiftlm"


class Exploit:
    """Unpickling it calls open(marker, "w"): the marker file appears if pickle ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def malicious_pt(path: Path, marker: Path) -> Path:
    torch.save({"state": torch.zeros(2), "payload": Exploit(marker)}, path)
    return path


def test_the_crafted_file_does_run_code_when_unpickled(tmp_path):
    """The bait works: torch.load(weights_only=False) creates the marker."""
    marker = tmp_path / "ran"
    torch.load(malicious_pt(tmp_path / "bait.pt", marker), weights_only=False)
    assert marker.exists()


@pytest.mark.bad_input(
    input="a checkpoint whose method state is a pickle (method_state_rank0.pt, as earlier "
    "versions wrote it, or crafted)",
    outcome="CheckpointError naming the file, nothing unpickled (before: torch.load("
    "weights_only=False) ran it)",
)
def test_pickled_method_state_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    malicious_pt(tmp_path / "method_state_rank0.pt", marker)
    with pytest.raises(CheckpointError, match=r"method_state_rank0\.pt, a pickle"):
        load_method_state(tmp_path, 0)
    assert not marker.exists()


def test_method_state_round_trips_as_safetensors_and_json(tmp_path):
    """What GRPO keeps between steps: micro-batches of tensors, prompt dicts, counters."""
    state = {
        "buffer": {
            "steps": [
                [{"input_ids": torch.arange(6).view(2, 3), "prompts": [{"row": "{}", "w": 1.5}]}]
            ]
        },
        "rollouts": {"generations": 3, "metrics": {"reward": 0.25}, "shape": (2, 3)},
    }
    save_tree(tmp_path / RANK_STATE_DIR, "method-rank0", state)
    loaded = load_method_state(tmp_path, 0)
    batch = loaded["buffer"]["steps"][0][0]
    assert torch.equal(batch["input_ids"], state["buffer"]["steps"][0][0]["input_ids"])
    assert batch["prompts"] == [{"row": "{}", "w": 1.5}]
    assert loaded["rollouts"] == {"generations": 3, "metrics": {"reward": 0.25}, "shape": (2, 3)}
    assert {p.name for p in (tmp_path / RANK_STATE_DIR).iterdir()} == {
        "method-rank0.json",
        "method-rank0.safetensors",
    }


def test_a_state_holding_an_arbitrary_object_is_refused_at_save(tmp_path):
    with pytest.raises(CheckpointError, match=r"state\.payload: a Exploit cannot be saved"):
        save_tree(tmp_path, "state", {"payload": Exploit(tmp_path / "x")})


def test_a_tampered_state_file_is_refused(tmp_path):
    save_tree(tmp_path, "state", {"a": 1})
    (tmp_path / "state.json").write_text(json.dumps({"format": "pickle", "tree": {}}))
    with pytest.raises(CheckpointError, match="not a swiftlm state file"):
        load_tree(tmp_path, "state")


def test_dcp_metadata_naming_a_function_is_refused_unread(tmp_path):
    import pickle

    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit(marker)))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        check_tensors_only(tmp_path)
    assert not marker.exists()


class FakeDeepSpeedEngine:
    """Loads as DeepSpeed's engine does: its TorchCheckpointEngine, torch.load(weights_only=
    False), on each file of the tag folder."""

    def __init__(self):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )

        self.checkpoint_engine, self.loaded = TorchCheckpointEngine(), {}
        self.dp_world_size = 1

    def zero_optimization_stage(self) -> int:
        return 3  # read as it is (no universal-format conversion)

    def load_checkpoint(self, load_dir, tag, **_):
        for file in sorted((Path(load_dir) / tag).glob("*.pt")):
            self.loaded[file.name] = self.checkpoint_engine.load(str(file), map_location="cpu")


@pytest.mark.bad_input(
    input="a DeepSpeed checkpoint file (deepspeed/state/*.pt) holding a pickled object that "
    "is not DeepSpeed's checkpoint state",
    outcome="CheckpointError naming the file; nothing unpickled (before: DeepSpeed's "
    "torch.load(weights_only=False) ran it)",
)
def test_deepspeed_files_load_weights_only(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from swiftlm.checkpoint.deepspeed import ENGINE_STATE_DIR, ENGINE_TAG, load_engine_state

    state = tmp_path / ENGINE_STATE_DIR / ENGINE_TAG
    state.mkdir(parents=True)
    # what DeepSpeed's ZeRO files hold: tensors, its loss scaler, its stage enum
    optim = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients}
    torch.save({"optimizer_state_dict": optim, "w": torch.ones(3)}, state / "optim_states.pt")
    engine = FakeDeepSpeedEngine()
    load_engine_state(tmp_path, engine)
    loaded = engine.loaded["optim_states.pt"]
    assert loaded["optimizer_state_dict"]["zero_stage"] == ZeroStageEnum.gradients
    assert loaded["optimizer_state_dict"]["loss_scaler"].cur_scale == 1.0
    assert torch.load is not None and torch.load.__name__ == "load"  # restored after

    marker = tmp_path / "ran"
    malicious_pt(state / "zz_model_states.pt", marker)
    with pytest.raises(CheckpointError, match=r"zz_model_states\.pt .* not DeepSpeed's own"):
        load_engine_state(tmp_path, FakeDeepSpeedEngine())
    assert not marker.exists()


# Where src/ may mention unpickling, and why it is safe there.
ALLOWED = {
    "checkpoint/sharded.py": "DCP metadata through an allow-list unpickler",
    "checkpoint/deepspeed.py": "torch.load forced to weights_only=True",
    "monitor/oom.py": "writes a memory snapshot (pickle.dump), never reads one",
}
LOADS = re.compile(r"torch\.load\b|pickle\.loads?\b|Unpickler|weights_only=False|\bshelve\b")


def code_of(path: Path) -> str:
    """The file without its comments and strings (docstrings may name what is avoided)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    skipped = (tokenize.COMMENT, tokenize.STRING)
    return " ".join(t.string for t in tokens if t.type not in skipped)


def test_no_other_source_file_unpickles():
    found = {
        str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if LOADS.search(code_of(path))
    }
    assert found <= set(ALLOWED), sorted(found - set(ALLOWED))
