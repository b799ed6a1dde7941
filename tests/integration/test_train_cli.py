"""`swiftlm sft` / `swiftlm pt` end to end on a tiny random Llama, through the CLI entry point."""

import json

import pytest
import torch

from conftest import CHAT_ROWS, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from tolerance import (
    assert_close,
    assert_same_weights,
    assert_trained_weights_close,
    backward_terms,
    forward_terms,
)

FAST = ["--torch_dtype", "float32", "--report_to", "none", "--logging_steps", "1"]
# CHAT_ROWS' conversations are shorter than 64 tokens.
TERMS = forward_terms(tokens=64)


def sft(tiny_model_dir, data, out, *extra) -> int:
    """`swiftlm sft` on the tiny model with the FAST flags, unless `extra` gives them."""
    argv = ["sft", "--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(out)]
    given = {str(x) for x in extra if str(x).startswith("--")}
    fast = [
        x
        for flag, value in zip(FAST[::2], FAST[1::2], strict=True)
        if flag not in given
        for x in (flag, value)
    ]
    return main(argv + fast + [str(x) for x in extra])


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def test_lora_run_learns_and_writes_a_complete_run_directory(tiny_model_dir, chat_jsonl, tmp_path):
    out = tmp_path / "run"
    code = sft(
        tiny_model_dir,
        chat_jsonl,
        out,
        "--num_train_epochs",
        10,
        "--learning_rate",
        "5e-3",
        "--per_device_train_batch_size",
        4,
        "--save_steps",
        10,
        "--save_total_limit",
        2,
        "--split_dataset_ratio",
        0.2,
        "--lora_dropout",
        0,
        "--report_to",
        "tensorboard",
    )
    assert code == 0
    metrics = read_metrics(out)
    losses = train_losses(out)
    assert losses[-1] < 0.5 * losses[0], losses
    step_rows = [m for m in metrics if "loss" in m]
    for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "epoch", "mfu"):
        assert key in step_rows[0]
    assert all(0 < row["mfu"] < 1 for row in step_rows)
    assert step_rows[0]["step"] == 1
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    # 19 training samples / batch 4 = 5 steps per epoch, 50 steps: saved every 10, keep 2.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-40", "step-50"]
    assert (out / "checkpoints" / "step-50" / "COMPLETE").is_file()
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert "train_type: lora" in (out / "config.yaml").read_text()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, out / "final")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b)  # B starts at zero, so it trained


def test_full_fine_tuning_saves_a_loadable_model(tiny_model_dir, chat_jsonl, tmp_path):
    out = tmp_path / "full"
    assert (
        sft(
            tiny_model_dir,
            chat_jsonl,
            out,
            "--train_type",
            "full",
            "--max_steps",
            4,
            "--learning_rate",
            "1e-3",
            "--per_device_train_batch_size",
            4,
        )
        == 0
    )
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "final")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(trained.parameters(), base.parameters(), strict=True)
    ]
    assert max(diffs) > 1e-4
    assert (out / "final" / "tokenizer.json").is_file()


# A template marking the assistant spans with {% generation %}, so transformers itself can
# compute the assistant-token mask: an independent reference for our masking and loss.
CHATML_WITH_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.numerics
def test_step_one_loss_equals_transformers_reference(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = CHAT_ROWS[:6]
    data = write_jsonl(tmp_path / "six.jsonl", rows)
    out = tmp_path / "ref"
    # One batch holds every sample, so the first batch is known without knowing the order.
    assert sft(tiny_model_dir, data, out, "--max_steps", 1, "--per_device_train_batch_size", 6) == 0
    logged = read_metrics(out)[0]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CHATML_WITH_GENERATION
    encoded = [
        tokenizer.apply_chat_template(
            r["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        for r in rows
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((6, width), tokenizer.pad_token_id)
    labels = torch.full((6, width), -100)
    mask = torch.zeros((6, width), dtype=torch.long)
    for i, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        mask[i, :n] = 1
        keep = torch.tensor(e["assistant_masks"], dtype=torch.bool)
        labels[i, :n] = torch.where(keep, ids[i, :n], torch.tensor(-100))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with (
        torch.no_grad()
    ):  # LoRA starts as an exact no-op (B = 0), so the base model is the reference
        reference = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    # Another padding and batch order of the same mean of token losses (a wrong mask or label
    # shift moves it by tenths).
    assert_close(logged["loss"], reference, terms=TERMS, what="step-1 loss")


@pytest.mark.numerics
def test_accumulation_matches_a_larger_batch(tiny_model_dir, chat_jsonl, tmp_path):
    common = ["--max_steps", 1, "--lora_dropout", 0, "--learning_rate", "1e-2"]
    assert (
        sft(
            tiny_model_dir, chat_jsonl, tmp_path / "b4", *common, "--per_device_train_batch_size", 4
        )
        == 0
    )
    assert (
        sft(
            tiny_model_dir,
            chat_jsonl,
            tmp_path / "a4",
            *common,
            "--per_device_train_batch_size",
            1,
            "--gradient_accumulation_steps",
            4,
        )
        == 0
    )
    m4, a4 = read_metrics(tmp_path / "b4")[0], read_metrics(tmp_path / "a4")[0]
    assert_close(a4["loss"], m4["loss"], terms=TERMS, what="loss")
    assert_close(a4["grad_norm"], m4["grad_norm"], terms=backward_terms(64), what="grad_norm")
    w4 = tmp_path / "b4" / "final" / "adapter_model.safetensors"
    wa = tmp_path / "a4" / "final" / "adapter_model.safetensors"
    assert_trained_weights_close(w4, wa, learning_rate=1e-2, steps=1)


class Crash(Exception):
    pass


@pytest.mark.numerics
@pytest.mark.parametrize("crash_at_micro_batch", [1, 0], ids=["mid-accumulation", "step-boundary"])
def test_resumed_run_equals_uninterrupted(
    tiny_model_dir, chat_jsonl, tmp_path, monkeypatch, crash_at_micro_batch
):
    # 24 samples, 4 per step (2 micro-batches of 2): 6 steps per epoch, 8 steps cross an epoch.
    common = [
        "--max_steps",
        8,
        "--save_steps",
        4,
        "--per_device_train_batch_size",
        2,
        "--gradient_accumulation_steps",
        2,
        "--learning_rate",
        "5e-3",
        "--lora_dropout",
        0.1,
    ]
    assert sft(tiny_model_dir, chat_jsonl, tmp_path / "straight", *common) == 0

    from swiftlm.methods.sft import SFT

    real_loss, calls = SFT.loss, {"n": 0}

    def crashing_loss(self, model, batch):
        if calls["n"] == 4 * 2 + crash_at_micro_batch:  # after step 4's checkpoint
            raise Crash("simulated crash")
        calls["n"] += 1
        return real_loss(self, model, batch)

    monkeypatch.setattr(SFT, "loss", crashing_loss)
    with pytest.raises(Crash):
        sft(tiny_model_dir, chat_jsonl, tmp_path / "resumed", *common)
    monkeypatch.setattr(SFT, "loss", real_loss)
    assert not (tmp_path / "resumed" / "final").exists()
    assert (
        sft(
            tiny_model_dir,
            chat_jsonl,
            tmp_path / "resumed",
            *common,
            "--resume_from_checkpoint",
            "auto",
        )
        == 0
    )

    # The same arithmetic on the same machine and shapes: bit for bit.
    straight = tmp_path / "straight" / "final" / "adapter_model.safetensors"
    assert_same_weights(straight, tmp_path / "resumed" / "final" / "adapter_model.safetensors")
    assert train_losses(tmp_path / "straight")[-4:] == train_losses(tmp_path / "resumed")[-4:]


def test_incomplete_checkpoint_is_skipped_on_resume(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--max_steps", 4, "--save_steps", 2, "--per_device_train_batch_size", 4]
    assert sft(tiny_model_dir, chat_jsonl, out, *common) == 0
    (out / "checkpoints" / "step-4" / "COMPLETE").unlink()  # as if killed while saving step 4
    capsys.readouterr()
    assert sft(tiny_model_dir, chat_jsonl, out, *common, "--resume_from_checkpoint", "auto") == 0
    printed = capsys.readouterr().out
    assert "skipping incomplete checkpoint" in printed and "step-4" in printed
    assert "resumed from" in printed and "step-2" in printed


def test_bad_rows_stop_before_training_and_skip_bad_rows_trains(tiny_model_dir, tmp_path, capsys):
    rows = [
        *CHAT_ROWS[:6],
        "{not json",
        {"messages": [{"role": "bot", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
        {"text_only": 1},
    ]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "bad-run"
    assert sft(tiny_model_dir, data, out, "--max_steps", 2) == 1
    err = capsys.readouterr().err
    assert f"{data}:7: invalid JSON" in err
    assert f"{data}:8: unknown role 'bot'" in err
    assert f"{data}:9: " in err and "empty assistant answer" in err
    assert f"{data}:10: " in err and "no recognizable format" in err
    assert "4 of 10 rows are invalid" in err
    assert not (out / "metrics.jsonl").exists()

    assert sft(tiny_model_dir, data, out, "--max_steps", 2, "--skip_bad_rows") == 0
    printed = capsys.readouterr().out
    assert "skipped 4 bad rows" in printed
    assert "data: 6 samples, " in printed


def test_unknown_flag_suggests_the_nearest(capsys):
    assert main(["sft", "--lora_rnak", "4"]) == 2
    assert "did you mean 'lora_rank'" in capsys.readouterr().err


def test_pretraining_on_text_trains_on_every_token(tiny_model_dir, tmp_path):
    docs = [{"text": "The quick brown fox jumps over the lazy dog. " * 6} for _ in range(8)]
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    (tmp_path / "notes.txt").write_text("Hello! How can I help you today? " * 10)
    out = tmp_path / "pt"
    argv = [
        "pt",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(data),
        str(tmp_path / "notes.txt"),
        "--output_dir",
        str(out),
        "--max_length",
        32,
        "--num_train_epochs",
        4,
        "--learning_rate",
        "5e-3",
        "--per_device_train_batch_size",
        4,
        *FAST,
    ]
    assert main([str(a) for a in argv]) == 0
    losses = train_losses(out)
    assert losses[-1] < 0.7 * losses[0]
    first = read_metrics(out)[0]
    # Every position but the last of each 32-token chunk predicts a token: 4 chunks x 31.
    assert first["label_tokens"] == 4 * 31


@pytest.mark.parametrize(
    ("flags", "config_key"),
    [(["--train_type", "dora"], "use_dora"), (["--use_rslora"], "use_rslora")],
    ids=["dora", "rslora"],
)
def test_lora_variants_save_adapters_that_peft_loads(
    tiny_model_dir, chat_jsonl, tmp_path, flags, config_key
):
    out = tmp_path / config_key
    assert (
        sft(tiny_model_dir, chat_jsonl, out, "--max_steps", 3, "--learning_rate", "1e-2", *flags)
        == 0
    )
    adapter_config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter_config[config_key] is True
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), out / "final"
    )
    if config_key == "use_dora":
        assert any("lora_magnitude_vector" in n for n, _ in model.named_parameters())


@pytest.mark.numerics
def test_gradient_checkpointing_gives_the_same_steps(tiny_model_dir, chat_jsonl, tmp_path):
    common = [
        "--max_steps",
        3,
        "--lora_dropout",
        0,
        "--learning_rate",
        "1e-2",
        "--per_device_train_batch_size",
        4,
    ]
    assert sft(tiny_model_dir, chat_jsonl, tmp_path / "plain", *common) == 0
    assert (
        sft(tiny_model_dir, chat_jsonl, tmp_path / "ckpt", *common, "--gradient_checkpointing") == 0
    )
    # Checkpointing recomputes the same forward in backward: the same arithmetic, bit for bit.
    assert train_losses(tmp_path / "ckpt") == train_losses(tmp_path / "plain")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_autocast_trains(tiny_model_dir, chat_jsonl, tmp_path, dtype):
    out = tmp_path / dtype
    run = dict(torch_dtype=dtype, num_train_epochs=6, learning_rate="5e-3")
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, out, per_device_train_batch_size=4, **run)) == 0
    )
    losses = train_losses(out)
    assert all(loss == loss for loss in losses)  # no NaN
    assert losses[-1] < 0.7 * losses[0]


def test_nonfinite_loss_policy(tiny_model_dir, chat_jsonl, tmp_path, monkeypatch, capsys):
    from swiftlm.methods.sft import SFT

    real_loss, calls = SFT.loss, {"n": 0}

    def nan_on_second_step(self, model, batch):
        calls["n"] += 1
        loss, metrics = real_loss(self, model, batch)
        return (loss * float("nan"), metrics) if calls["n"] == 2 else (loss, metrics)

    monkeypatch.setattr(SFT, "loss", nan_on_second_step)
    common = ["--max_steps", 3, "--per_device_train_batch_size", 4]
    assert sft(tiny_model_dir, chat_jsonl, tmp_path / "err", *common) == 1
    assert "step 2: loss nan" in capsys.readouterr().err

    calls["n"] = 0
    assert (
        sft(tiny_model_dir, chat_jsonl, tmp_path / "skip", *common, "--nonfinite_loss", "skip") == 0
    )
    assert "step 2: loss nan; non-finite on rank 0" in capsys.readouterr().out
    assert (tmp_path / "skip" / "final" / "adapter_model.safetensors").is_file()
