"""FLOPs per token and MFU bookkeeping."""

import pytest
import torch

from swiftlm.monitor import mfu


class TwoLinear(torch.nn.Module):
    def __init__(self, frozen_first: bool):
        super().__init__()
        self.a = torch.nn.Linear(8, 16, bias=False)
        self.b = torch.nn.Linear(16, 4, bias=False)
        self.embed = torch.nn.Embedding(100, 8)  # a lookup: no FLOPs
        self.a.weight.requires_grad_(not frozen_first)


def test_full_training_is_three_forwards_of_the_matmuls():
    model = TwoLinear(frozen_first=False)
    assert mfu.linear_parameters(model) == (8 * 16 + 16 * 4, 8 * 16 + 16 * 4)
    forward = 2 * (8 * 16 + 16 * 4)  # no config: no attention term
    assert mfu.flops_per_token(model, seq_len=32) == 3 * forward
    assert mfu.flops_per_token(model, seq_len=32, recompute=True) == 4 * forward


def test_frozen_weights_skip_their_weight_gradients():
    model = TwoLinear(frozen_first=True)
    forward = 2 * (8 * 16 + 16 * 4)
    # backward: activation gradients (one forward) + weight gradients of b only
    assert mfu.flops_per_token(model, seq_len=32) == forward + forward + 2 * 16 * 4


def test_attention_term_grows_with_the_sequence(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    short, long = mfu.flops_per_token(model, 64), mfu.flops_per_token(model, 128)
    # 2 layers x hidden 64 x 64 more tokens x 2 FLOPs, forward; x3 with the backward
    assert long - short == pytest.approx(3 * 2 * 2 * 64 * 64)


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTLM_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(mfu, "measure_peak", lambda device, dtype: calls.append(1) or 1e11)
    cpu = torch.device("cpu")
    assert mfu.peak_flops(cpu, torch.float32) == 1e11
    assert mfu.peak_flops(cpu, torch.float32) == 1e11
    assert len(calls) == 1 and (tmp_path / "peak_flops.json").is_file()


def test_measured_peak_is_a_plausible_rate():
    assert 1e8 < mfu.measure_peak(torch.device("cpu"), torch.float32) < 1e14
