"""The output checks as a user meets them: the real `swiftlm` command in a subprocess. The
cases of every output flag run in-process in tests/unit/test_outputs.py."""

import subprocess
import sys

import pytest

from conftest import CHAT_ROWS, write_jsonl


@pytest.mark.bad_input(
    input="`swiftlm infer --val_dataset rows.jsonl --result_path rows.jsonl` (the results file "
    "is the dataset; before, exit 0 with the dataset rewritten)",
    outcome="Exit 2 before any model loads, naming --result_path, --val_dataset and a free path "
    "(rows-out.jsonl); rows.jsonl is left byte-identical",
)
def test_infer_does_not_write_its_results_over_its_dataset(tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", CHAT_ROWS[:3])
    before = rows.read_bytes()
    argv = ["infer", "--val_dataset", "rows.jsonl", "--result_path", "rows.jsonl"]
    done = subprocess.run(
        [sys.executable, "-m", "swiftlm", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "swiftlm infer: error: --result_path rows.jsonl is --val_dataset rows.jsonl, an input of "
        "this run: swiftlm does not write over what it reads; pass a path of its own, e.g. "
        "--result_path rows-out.jsonl"
    )
    assert "Loading" not in done.stdout
    assert rows.read_bytes() == before
