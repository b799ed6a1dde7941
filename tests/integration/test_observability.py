"""Where the step time goes, gradient health and non-finite steps, on real tiny runs.

The breakdown must account for the measured step time; a slow loader must show as data wait;
on 2 gloo ranks the communication share must be there and fall when the gradients are sent in
fp16; a NaN made inside a layer must be traced to that layer; per-layer histograms must be
readable from TensorBoard's event files.
"""

import json
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import build_tokenizer, make_tiny_llama, max_weight_difference, tiny_sft
from swiftlm.cli.main import main
from swiftlm.config.commands import TrainConfig
from swiftlm.config.parse import parse_config
from swiftlm.methods.sft import SFT
from swiftlm.monitor.step_time import StepTimer
from swiftlm.train import loop, observe
from swiftlm.train.run import run_method


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def config(model, data, out, **flags) -> TrainConfig:
    return parse_config(TrainConfig, tiny_sft(model, data, out, **flags)[1:], "sft")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """Hidden 256 (1.4M parameters): steps long enough (tens of ms) to measure, and full
    fine-tuning gradients big enough (5.5 MB) that their all-reduce shows."""
    out = tmp_path_factory.mktemp("wide-llama")
    tokenizer = build_tokenizer(out)
    make_tiny_llama(len(tokenizer), hidden_size=256).save_pretrained(out)
    return out


def test_breakdown_accounts_for_the_step_time(wide_model_dir, chat_jsonl, tmp_path):
    out = tmp_path / "run"
    flags = dict(max_steps=12, logging_steps=4, per_device_train_batch_size=4, save_steps=6)
    assert main(tiny_sft(wide_model_dir, chat_jsonl, out, **flags)) == 0
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 4, 8, 12]
    for row in logged:
        shares = {k: v for k, v in row.items() if k.startswith("share/")}
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)
        assert {"share/forward", "share/backward", "share/optimizer", "share/data"} <= set(shares)
        assert row["share/other"] < 0.05, row  # what no phase covers: the phases explain it
        phases = sum(v for k, v in row.items() if k.startswith("time/") and k != "time/step_s")
        assert phases == pytest.approx(row["time/step_s"], rel=1e-3)
        compute = row["share/forward"] + row["share/backward"] + row["share/optimizer"]
        assert row["goodput"] == pytest.approx(compute, abs=1e-3)
    # On average the phases explain all but 2% of a step (a garbage-collector pause between
    # two phases is "other").
    assert sum(r["share/other"] for r in logged) / len(logged) < 0.02
    # Against the loop's own clock: the windows' step times add up to the elapsed time.
    windows = sum(
        r["time/step_s"] * (r["step"] - before["step"])
        for before, r in zip([{"step": 0}, *logged], logged, strict=False)
    )
    assert windows == pytest.approx(logged[-1]["elapsed_s"], rel=0.02, abs=0.02)
    # The checkpoint of step 6 is saved after its log line: it lands in the next window.
    assert logged[2]["time/checkpoint_s"] > 0 and "time/checkpoint_s" not in logged[1]
    assert set(logged[-1]["grad_norm_layers"]) == {"layers.0", "layers.1"}  # LoRA's layers


# The slow loader's delay, in seconds of the step timer's clock: far more than any real phase of
# these tiny steps takes on any machine, so where it lands is plain whatever the load.
DELAY_S = 60.0


class DelayClock:
    """perf_counter plus the delays added to it: a slow loader that is not slept, so the test
    reads where its delay went without a wall-clock tolerance."""

    def __init__(self):
        self.delays = 0

    def __call__(self) -> float:
        return time.perf_counter() + self.delays * DELAY_S


class SlowLoaderSFT(SFT):
    """SFT whose batches take DELAY_S more to collate (on the step timer's clock): a slow data
    pipeline."""

    clock: DelayClock  # set by the test

    def collate(self, layout):
        self.clock.delays += 1
        return super().collate(layout)


def test_a_slow_loader_shows_as_data_wait(wide_model_dir, chat_jsonl, tmp_path, monkeypatch):
    clock = DelayClock()
    monkeypatch.setattr(SlowLoaderSFT, "clock", clock, raising=False)
    monkeypatch.setattr(observe, "StepTimer", partial(StepTimer, clock=clock))
    flags = dict(max_steps=6, logging_steps=3, per_device_train_batch_size=4)
    run_method(config(wide_model_dir, chat_jsonl, tmp_path / "fast", **flags), SFT)
    assert clock.delays == 0  # the fast run ran on the real clock
    run_method(config(wide_model_dir, chat_jsonl, tmp_path / "slow", **flags), SlowLoaderSFT)
    assert clock.delays == 6  # one micro-batch per step
    fast, slow = rows(tmp_path / "fast")[-1], rows(tmp_path / "slow")[-1]
    # The delay is data wait, once per step (the real part of the phase is far below a delay),
    # and no other phase holds any of it.
    assert DELAY_S <= slow["time/data_s"] < 2 * DELAY_S
    others = [k for k in slow if k.startswith("time/") and k not in ("time/data_s", "time/step_s")]
    assert "time/forward_s" in others and all(slow[k] < DELAY_S for k in others), slow
    # A loader that only indexes tokenized rows waits less than the step computes.
    assert fast["time/data_s"] < fast["time/forward_s"] + fast["time/backward_s"]
    assert slow["share/data"] > fast["share/data"] + 0.15
    assert slow["goodput"] < fast["goodput"]


def inject_nan_in_layer(monkeypatch, step: int, module: str = "layers.1.mlp") -> None:
    """During optimizer step `step` only, `module` (the MLP of decoder layer 1) outputs NaN: in
    the training forward and in the re-run that looks for the layer."""
    current = {"step": 0}
    real_forward_backward, real_loss = loop.forward_backward, SFT.loss

    def counting(job, precision, batches):
        current["step"] += 1
        return real_forward_backward(job, precision, batches)

    def poisoned(self, model, batch):
        if current["step"] != step:
            return real_loss(self, model, batch)
        target = next(m for name, m in model.named_modules() if name.endswith(module))
        hook = target.register_forward_hook(lambda module, inputs, out: _nan(out))
        try:
            return real_loss(self, model, batch)
        finally:
            hook.remove()

    monkeypatch.setattr(loop, "forward_backward", counting)
    monkeypatch.setattr(SFT, "loss", poisoned)


def _nan(output):
    if isinstance(output, tuple):  # older transformers: (hidden states, ...)
        return (output[0] * float("nan"), *output[1:])
    return output * float("nan")


@pytest.mark.bad_input(
    input="A NaN in training: a layer's output (or the loss, or a gradient) goes non-finite at "
    "step k",
    outcome="Stops at step k (exit 1) naming the step, the rank whose loss went non-finite, the "
    "first layer whose output is not finite (the step's forward is run again to find it) and "
    "`--nonfinite_loss skip`; with skip exactly that step is skipped, counted in "
    "`skipped_steps` and listed in anomalies.jsonl",
)
def test_nan_in_a_layer_stops_the_run_naming_step_and_layer(
    tiny_model_dir, chat_jsonl, tmp_path, monkeypatch, capsys
):
    inject_nan_in_layer(monkeypatch, step=3)
    argv = tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "err", max_steps=5)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "step 3: loss nan; non-finite on rank 0" in err
    assert "the first layer whose output is not finite: layers.1 (" in err
    assert "--nonfinite_loss skip" in err  # the fix


def test_skip_skips_exactly_the_nan_step(tiny_model_dir, chat_jsonl, tmp_path, monkeypatch):
    inject_nan_in_layer(monkeypatch, step=3)
    out = tmp_path / "skip"
    argv = tiny_sft(tiny_model_dir, chat_jsonl, out, max_steps=5, save_steps=1)
    assert main([*argv, "--nonfinite_loss", "skip", "--learning_rate", "1e-3"]) == 0
    logged = rows(out)
    assert [r["skipped_steps"] for r in logged] == [0, 0, 1, 1, 1]
    anomalies = [json.loads(x) for x in (out / "anomalies.jsonl").read_text().splitlines()]
    assert [(a["step"], a["kind"]) for a in anomalies] == [(3, "nonfinite")]
    assert "layers.1" in anomalies[0]["message"]

    def adapter(step: int) -> Path:
        return out / "checkpoints" / f"step-{step}" / "adapter_model.safetensors"

    assert max_weight_difference(adapter(2), adapter(3)) == 0  # step 3 changed nothing
    assert max_weight_difference(adapter(3), adapter(4)) > 0  # and training went on
    assert all(r["loss"] == r["loss"] for r in logged if r["step"] != 3)


def test_layer_histograms_read_back_from_tensorboard(tiny_model_dir, chat_jsonl, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    flags = dict(max_steps=4, histogram_steps=2, report_to="tensorboard", logging_steps=2)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, **flags)) == 0
    events = EventAccumulator(str(out / "tb"), size_guidance={"histograms": 0}).Reload()
    tags = events.Tags()["histograms"]
    assert {"grad_log10_abs/layers.0", "grad_log10_abs/layers.1"} <= set(tags)
    values = events.Histograms("grad_log10_abs/layers.0")
    assert [v.step for v in values] == [1, 2, 4]
    # Every LoRA entry of layer 0 is counted: 7 projections x (A + B), rank 8, hidden 64.
    lora = sum(
        p.numel() for name, p in _lora_shapes(tiny_model_dir).items() if ".layers.0." in name
    )
    assert values[0].histogram_value.num == lora
    assert "grad_norm_layers/layers.1" in events.Tags()["scalars"]
    file_rows = [json.loads(x) for x in (out / "grad_histograms.jsonl").read_text().splitlines()]
    assert [r["step"] for r in file_rows] == [1, 2, 4]
    assert sum(file_rows[0]["layers"]["layers.0"]) == lora


def _lora_shapes(model_dir: Path) -> dict[str, torch.Tensor]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    return {n: p for n, p in peft.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def wide_vocab_model_dir(tmp_path_factory) -> tuple[Path, int]:
    """(folder, parameters) of a 65,536-entry (tied) embedding on a hidden-64 Llama: 4.3M
    parameters, 17 MB of fp32 gradient to all-reduce per step, while a step computes little.
    Full fine-tuning makes communication a third of the step on 2 gloo ranks; LoRA sends next
    to nothing."""
    out = tmp_path_factory.mktemp("wide-vocab")
    build_tokenizer(out)  # ids < 400 of the 65,536: the rest train as zeros, sent all the same
    model = make_tiny_llama(65536, hidden_size=64, tie=True)
    model.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def ddp_rows(model, data, out, port: int, **flags) -> list[dict]:
    argv = tiny_sft(
        model, data, out, max_steps=15, logging_steps=5, per_device_train_batch_size=1,
        split_dataset_ratio=0, save_steps=1000, nproc_per_node=2, master_port=port, **flags,
    )  # fmt: skip
    assert main(argv) == 0
    return rows(out)


def mean_after_warmup(logged: list[dict], key: str) -> float:
    return sum(r[key] for r in logged[1:]) / len(logged[1:])


def test_communication_share_on_two_ranks_follows_the_gradient_bytes(
    wide_vocab_model_dir, chat_jsonl, tmp_path
):
    """The collective phase is measured, not guessed: 8.5 MB of fp16 gradients per step show
    as a large share; LoRA's 0.1 MB as a few ms.

    fp16 halves the bytes (asserted exactly) but does not make the step faster on gloo (CPU):
    gloo sums fp16 in software at about the fp32 rate per element and the cast costs about
    what the bytes saved (benchmarks/gloo_allreduce_dtypes.py), so the full run is not also
    repeated in fp32 to compare shares that would not differ."""
    model, parameters = wide_vocab_model_dir
    full = ddp_rows(
        model, chat_jsonl, tmp_path / "fp16", 29944, train_type="full", grad_compression="fp16"
    )
    lora = ddp_rows(model, chat_jsonl, tmp_path / "lora", 29946, train_type="lora")
    for row in full:
        assert row["share/collective"] > 0
        assert 0 <= row["comm_hidden_share"] <= 1
        assert row["communication_efficiency"] > 0 and row["comm_bus_gbps"] > 0
        assert len(row["rank_step_s"]) == len(row["rank_utilization"]) == 2
    # Two bytes per parameter; a ring all-reduce over 2 ranks sends the payload once.
    assert full[-1]["comm_bytes_per_rank"] == 2 * parameters
    assert full[-1]["comm_bytes_per_rank"] > 50 * lora[-1]["comm_bytes_per_rank"]
    # A third of the step here (noise moves it a few points) ...
    assert mean_after_warmup(full, "share/collective") > 0.15
    # ... against a few ms for LoRA: the loop's own small all-reduces (a share of a much
    # shorter step, so seconds are compared).
    seconds = mean_after_warmup(lora, "time/collective_s")
    assert seconds < mean_after_warmup(full, "time/collective_s") / 3
