"""The step-time bookkeeping: exclusive nested phases, shares, goodput, communication timing,
gradient health by layer and spike detection, on fake clocks and hand-made gradients."""

import math

import pytest
import torch

from swiftlm.distributed.comm_timing import CommTimer, ring_allreduce_bytes, union_seconds
from swiftlm.monitor.anomalies import MIN_HISTORY, AnomalyLog, SpikeDetector
from swiftlm.monitor.grad_health import HIST_EDGES, GradientHealth, layer_group
from swiftlm.monitor.step_time import StepTimer


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def test_nested_phases_are_exclusive_and_shares_add_up():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    for _ in range(2):  # two steps of 1.0 s each
        with timer.phase("data"):
            clock.tick(0.1)
            with timer.phase("reward"):  # inside data: counted for reward only
                clock.tick(0.2)
            clock.tick(0.05)
        with timer.phase("forward"):
            clock.tick(0.3)
        with timer.phase("backward"):
            clock.tick(0.2)
            timer.add("collective", 0.05, out_of="backward")  # exposed communication
        clock.tick(0.1)  # no phase: other
        timer.step_done()
    row = timer.flush()
    assert row["time/step_s"] == pytest.approx(0.95)
    assert row["time/data_s"] == pytest.approx(0.15)
    assert row["time/reward_s"] == pytest.approx(0.2)
    assert row["time/backward_s"] == pytest.approx(0.15)
    assert row["time/collective_s"] == pytest.approx(0.05)
    assert row["time/other_s"] == pytest.approx(0.1)
    shares = {k: v for k, v in row.items() if k.startswith("share/")}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-5)
    assert row["goodput"] == pytest.approx((0.3 + 0.15) / 0.95, abs=1e-5)
    assert "time/checkpoint_s" not in row  # phases that did not run are left out


def test_flush_counts_an_open_phase_up_to_now_and_carries_it_on():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    with timer.phase("logging"):
        clock.tick(0.5)
        timer.step_done()
        first = timer.flush()
        clock.tick(0.25)
    timer.step_done()
    second = timer.flush()
    assert first["time/logging_s"] == pytest.approx(0.5)
    assert second["time/logging_s"] == pytest.approx(0.25)
    assert second["time/step_s"] == pytest.approx(0.25)


def test_union_of_bucket_intervals_and_exposed_wait():
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_seconds([(0, 4), (1, 2)]) == pytest.approx(4.0)
    assert union_seconds([]) == 0.0
    clock = FakeClock()
    timer = CommTimer(clock=clock)
    clock.tick(1.0)
    started = timer.ready()  # the last bucket is ready at t=1.0
    clock.tick(0.3)
    timer.done(started)
    assert timer.exposed_since(backward_end=1.4, backward_start=0.5) == pytest.approx(0.4)
    assert timer.exposed_since(backward_end=3.0, backward_start=2.0) == 0.0  # no bucket in it
    assert timer.busy_and_reset() == pytest.approx(0.3)
    assert timer.busy_and_reset() == 0.0
    assert ring_allreduce_bytes(100, 2) == 100 and ring_allreduce_bytes(100, 4) == 150


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.embed_tokens.weight", "embed"),
        ("base_model.model.model.layers.11.self_attn.q_proj.lora_A.default.weight", "layers.11"),
        ("model.layers.0", "layers.0"),
        ("transformer.h.3.attn.c_attn.weight", "layers.3"),
        ("transformer.wte.weight", "embed"),
        ("model.norm.weight", "norm"),
        ("lm_head.weight", "lm_head"),
        ("score.weight", "score"),
        ("something.else", "other"),
    ],
)
def test_parameters_group_by_layer(name, group):
    assert layer_group(name) == group


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(4, 3)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])
        self.lm_head = torch.nn.Linear(3, 4, bias=False)


def test_layer_norms_histograms_and_the_first_bad_gradient():
    model = TwoLayers()
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.5)
    health = GradientHealth(model)
    assert health.groups == ["embed", "layers.0", "layers.1", "lm_head"]
    norms = health.layer_norms()
    assert norms["layers.0"] == pytest.approx(0.5 * math.sqrt(9 + 3))
    assert norms["embed"] == pytest.approx(0.5 * math.sqrt(12))
    histograms = health.histograms()
    assert sum(histograms["lm_head"]) == 12
    bin_of_half = int((math.log10(0.5) - HIST_EDGES[0]) / (HIST_EDGES[1] - HIST_EDGES[0]))
    assert histograms["lm_head"][bin_of_half] == 12
    assert health.first_nonfinite_gradient() is None
    model.layers[0].weight.grad[0, 0] = float("nan")
    model.embed_tokens.weight.grad[0, 0] = float("inf")
    assert health.first_nonfinite_gradient() == "layers.0.weight"  # nearest the output


def test_spikes_against_the_running_median(tmp_path):
    detector = SpikeDetector("loss", factor=3.0)
    for step in range(1, MIN_HISTORY + 1):
        assert detector.check(step, 1.0 + 0.01 * step) is None
    spike = detector.check(MIN_HISTORY + 1, 5.0)
    assert spike["kind"] == "loss_spike" and spike["factor"] == pytest.approx(5 / 1.055, rel=1e-2)
    assert detector.check(MIN_HISTORY + 2, 2.0) is None  # below 3x the median
    assert detector.check(MIN_HISTORY + 3, float("nan")) is None  # the non-finite path's job
    lines = []
    log = AnomalyLog(tmp_path, 3.0, lines.append, resume=False)
    for step in range(1, 12):
        log.check(step, 1.0, 1.0)
    log.check(12, 1.0, 10.0)
    assert log.count == 1 and "grad_norm spike 10" in lines[0]
    assert '"grad_norm_spike"' in (tmp_path / "anomalies.jsonl").read_text()
