"""`swiftlm sft --fp8_recipe` end to end (torchao float8, emulated on CPU): the run trains,
resumes exactly, and saves an ordinary model."""

import pytest

from conftest import logged, stopped_at, tiny_sft
from swiftlm.cli.main import main
from tolerance import (
    assert_close,
    assert_same_weights,
    assert_trained_weights_close,
    forward_terms,
)

FULL = dict(train_type="full", max_steps=4, save_steps=2, learning_rate="1e-3", lora_dropout=0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_run_resumes_exactly_and_saves_an_ordinary_model(
    recipe, tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, fp8_recipe=recipe, **FULL)) == 0
    assert f"fp8 training ({recipe} scaling, emulated on cpu" in capsys.readouterr().out
    resumed = stopped_at(run, 2, tmp_path / "resumed")
    again = dict(FULL, fp8_recipe=recipe, resume_from_checkpoint="auto")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **again)) == 0
    assert logged(resumed) == logged(run)  # same arithmetic after the resume: exactly equal
    assert_same_weights(
        run / "final" / "model.safetensors", resumed / "final" / "model.safetensors"
    )
    # The saved model is the base's tensors under the base's names: float8 is not in the file.
    saved = load_file(run / "final" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert saved.keys() == base.keys()
    assert any(not saved[k].equal(base[k]) for k in base)  # and it trained


@pytest.mark.bad_input(
    input="`--fp8_recipe` with a bitsandbytes base (`--quant_method bnb`)",
    outcome="Usage error before loading: float8 cannot convert quantized layers; drop one",
)
def test_fp8_on_a_quantized_base_is_refused(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    argv = tiny_sft(
        tiny_model_dir, chat_jsonl, tmp_path / "run", fp8_recipe="rowwise", quant_method="bnb"
    )
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "--fp8_recipe rowwise with --quant_method bnb" in error and "drop one" in error


@pytest.mark.numerics
def test_fp8_two_ranks_match_one_process(tiny_model_dir, chat_jsonl, tmp_path):
    """DDP over 2 gloo ranks with float8 layers = one process accumulating the same two
    micro-batches: float8 scales are per micro-batch tensor, the same on both sides."""
    flags = dict(FULL, fp8_recipe="tensorwise", per_device_train_batch_size=2, save_steps=4)
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, single, **flags, gradient_accumulation_steps=2))
        == 0
    )
    argv = tiny_sft(tiny_model_dir, chat_jsonl, ddp, **flags, nproc_per_node=2, master_port=29535)
    assert main(argv) == 0
    assert_close(logged(ddp), logged(single), terms=forward_terms(tokens=64) + 2, what="loss")
    weights = "model.safetensors"
    assert_trained_weights_close(
        single / "final" / weights, ddp / "final" / weights, learning_rate=1e-3, steps=4
    )
