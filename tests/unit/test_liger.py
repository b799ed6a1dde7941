"""--use_liger_kernel where Liger cannot run: refused by name, before any step (the kernels
themselves are checked against the plain path in tests/gpu)."""

import sys

import pytest
import torch

from conftest import tiny_sft
from swiftlm.cli.main import main
from swiftlm.errors import ConfigError
from swiftlm.models.liger import check_liger


@pytest.mark.bad_input(
    input="`swiftlm sft --use_liger_kernel true` on a machine without a CUDA GPU",
    outcome="Exit 2 before the first step: Liger's kernels are Triton kernels for CUDA GPUs; "
    "the message names the flag and what the CPU run already has (--fused_cross_entropy)",
)
def test_liger_on_a_cpu_run_is_refused_by_name(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "run"
    argv = tiny_sft(tiny_model_dir, chat_jsonl, out, use_liger_kernel="true", max_steps=2)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs" in err
    assert "this run trains on cpu" in err and "--fused_cross_entropy" in err
    assert not (out / "checkpoint-2").exists()


def test_liger_on_cuda_without_the_package_names_the_extra(monkeypatch):
    # None in sys.modules makes the import fail as if liger-kernel were not installed.
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ConfigError, match=r"needs liger-kernel.*pip install 'swiftlm\[liger\]'"):
        check_liger(torch.device("cuda"))
