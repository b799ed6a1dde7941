"""Gradient compression's checkpoint state without processes: top-k residuals travel by
parameter name, PowerSGD's buffers follow their parameters into DDP's rebuilt buckets, and a
resume with another --grad_compression says what happens to the saved state."""

import re

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from swiftlm.distributed.compression import CommStats, HookState, PowerSGDCountingState, TopKState
from swiftlm.distributed.compression_checkpoint import CompressionCheckpoint, PowerSGDLayouts


def named_params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 6, bias=False))
    return dict(model.named_parameters())


def topk_checkpoint(params) -> CompressionCheckpoint:
    return CompressionCheckpoint("topk", TopKState(None, CommStats("topk"), 0.1), params)


def test_topk_residuals_are_saved_by_name_and_restored_to_other_parameter_objects():
    saving, params = topk_checkpoint(named_params()), named_params()
    residuals = {name: torch.randn(p.numel()) for name, p in params.items()}
    saving.hook_state.residuals = {
        id(saving.params[saving.ids[n]]): r for n, r in residuals.items()
    }
    state = saving.state_dict()
    assert state["method"] == "topk" and set(state["residuals"]) == set(residuals)

    fresh_params = named_params()  # the resumed process: other objects, same names
    loading = topk_checkpoint(fresh_params)
    assert loading.load_state_dict(state) is None
    for name, p in fresh_params.items():
        assert torch.equal(loading.hook_state.residuals[id(p)], residuals[name])


@pytest.mark.parametrize(
    ("saved", "now", "note"),
    [
        (
            {"method": "topk", "residuals": {}},
            "none",
            r"topk state \(the gradient not sent yet\) is dropped",
        ),
        ({"method": "none"}, "topk", r"empty state \(saved with --grad_compression none\)"),
        (None, "topk", r"empty state \(none for this rank\)"),
        ({"method": "fp16"}, "none", None),
    ],
)
def test_another_compression_on_resume_is_said(saved, now, note):
    params = named_params()
    state = TopKState(None, CommStats(now), 0.1) if now == "topk" else HookState(None, None)
    said = CompressionCheckpoint(now, state, params).load_state_dict(saved)
    if note is None:
        assert said is None
    else:
        assert said is not None and re.search(note, said), said


class FakeBucket:
    def __init__(self, index: int, params: list):
        self._index, self._params = index, params
        self._buffer = torch.zeros(sum(p.numel() for p in params))

    def index(self) -> int:
        return self._index

    def parameters(self) -> list:
        return self._params

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_powersgd_buffers_follow_their_parameters_into_rebuilt_buckets():
    """Bucket 0 first holds [a, b, c], then (DDP's rebuild) [c, a] and bucket 1 [b]: each
    parameter's error and Q must be where that parameter now is, in torch's Q order."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.zeros(shape)) for shape in [(8, 5), (5,), (6, 8)])
    ps = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    layouts = PowerSGDLayouts(ps, {id(p): p for p in (a, b, c)})
    layouts.align(FakeBucket(0, [a, b, c]))
    error = torch.randn(40 + 5 + 48)
    q = torch.randn(5 + 8)  # Q's of a (5 x 1) then c (8 x 1); b (a vector) is not compressed
    ps.error_dict[0], ps.q_memory_dict[0], ps.p_memory_dict[0] = error, q, torch.empty(14)

    layouts.align(FakeBucket(0, [c, a]))
    layouts.align(FakeBucket(1, [b]))
    assert torch.equal(ps.error_dict[0], torch.cat([error[45:], error[:40]]))
    assert torch.equal(ps.error_dict[1], error[40:45])
    # shapes (6, 8) then (8, 5): c's Q first now
    assert torch.equal(ps.q_memory_dict[0], torch.cat([q[5:], q[:5]]))
    assert ps.p_memory_dict[0].numel() == 6 + 8 and 1 not in ps.q_memory_dict

    names = {id(a): "a", id(b): "b", id(c): "c"}
    ps.iter, ps.rng = 7, np.random.RandomState(3)
    draws = np.random.RandomState(3).randint(1_000_000_000, size=2)
    state = layouts.state_dict(names)
    assert not ps.error_dict  # moved out; the next hook call packs them again
    a2, b2, c2 = (torch.nn.Parameter(torch.zeros(p.shape)) for p in (a, b, c))
    ps2 = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    resumed = PowerSGDLayouts(ps2, {id(p): p for p in (a2, b2, c2)})
    resumed.load_state_dict(state, {"a": id(a2), "b": id(b2), "c": id(c2)})
    assert ps2.iter == 7 and list(ps2.rng.randint(1_000_000_000, size=2)) == list(draws)
    resumed.align(FakeBucket(0, [a2, b2, c2]))  # the resumed run's first buckets
    assert torch.equal(ps2.error_dict[0], error)
    assert torch.equal(ps2.q_memory_dict[0], q)


def test_powersgd_checkpoint_has_the_method_and_its_state():
    params = named_params()
    ps = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    layouts = PowerSGDLayouts(ps, {id(p): p for p in params.values()})
    hook_state = PowerSGDCountingState(None, CommStats("powersgd"), ps, layouts)
    state = CompressionCheckpoint("powersgd", hook_state, params).state_dict()
    assert state["method"] == "powersgd" and state["powersgd"]["iter"] == 0
    assert state["powersgd"]["rng"]["keys"].dtype == torch.int64


def test_topk_cuts_its_blocks_in_the_model_order_whatever_the_bucket_order():
    """The resumed run's first buckets list parameters in another order than the saved run's
    rebuilt ones; top-k lays them out in the model's order before it picks."""
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 4))
    state = TopKState(None, CommStats("topk"), 0.5, order={id(a): 0, id(b): 1, id(c): 2})
    assert state.canonical(FakeBucket(0, [c, a, b])) == [1, 2, 0]  # a, b, c
    assert state.canonical(FakeBucket(0, [a, b, c])) == [0, 1, 2]
