"""`swiftlm sft` on a mixture-of-experts model: the router loss joins the training loss by its
coefficient, router health reaches metrics.jsonl and report.html, LoRA reaches the experts."""

import json

import pytest

from conftest import logged, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, forward_terms

RUN = dict(max_steps=3, lora_dropout=0, per_device_train_batch_size=4, learning_rate="1e-3")


@pytest.mark.numerics
def test_router_aux_loss_joins_the_loss_and_router_health_is_logged(
    tiny_moe_dir, chat_jsonl, tmp_path
):
    plain, balanced = tmp_path / "plain", tmp_path / "balanced"
    assert main(tiny_sft(tiny_moe_dir, chat_jsonl, plain, **RUN)) == 0
    argv = tiny_sft(tiny_moe_dir, chat_jsonl, balanced, **RUN, router_aux_loss_coef=0.5)
    assert main(argv) == 0
    # Step 1 runs the same weights on the same rows: the losses differ by 0.5 x the aux loss.
    aux = logged(balanced, "router_aux_loss")[0]
    assert logged(plain, "router_aux_loss")[0] == pytest.approx(aux, rel=1e-5)
    difference = logged(balanced)[0] - logged(plain)[0]
    assert_close(difference, 0.5 * aux, terms=forward_terms(64), magnitude=logged(balanced)[0])
    assert 1.0 < aux < 8.0  # top_k (2) for an even load, at most the experts (8)
    rows = [json.loads(line) for line in (balanced / "metrics.jsonl").read_text().splitlines()]
    load = rows[0]["router_expert_load"]
    assert list(load) == ["layer 0", "layer 1"]
    for shares in load.values():
        assert len(shares) == 8 and sum(shares) == pytest.approx(1.0, abs=1e-4)
    assert rows[0]["router_load_max"] == pytest.approx(max(map(max, load.values())) * 8, abs=1e-3)
    assert 0 < rows[0]["router_entropy"] < 2.08  # below log(8): the routers are not uniform
    page = (balanced / "report.html").read_text()
    assert "Mixture of experts" in page and "Load per expert (latest window)" in page
    # LoRA reached the stacked experts (peft's target parameters) and they trained.
    adapter = json.loads((balanced / "final" / "adapter_config.json").read_text())
    assert {"gate_up_proj", "down_proj"} <= set(adapter["target_parameters"])


def _error_of(capsys, argv) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.bad_input(
    input="`--lora_dropout` above 0 with LoRA on a mixture-of-experts model's stacked experts",
    outcome="Usage error before training: peft's LoRA on expert weights takes no dropout; "
    "names --lora_dropout 0 or attention-only --target_modules",
)
def test_lora_dropout_on_stacked_experts_is_refused(tiny_moe_dir, chat_jsonl, tmp_path, capsys):
    error = _error_of(capsys, tiny_sft(tiny_moe_dir, chat_jsonl, tmp_path / "run", max_steps=1))
    assert "--lora_dropout 0.05: --target_modules all-linear reaches the stacked expert" in error
    assert "pass --lora_dropout 0" in error and "q_proj k_proj v_proj o_proj" in error


@pytest.mark.bad_input(
    input="`--router_aux_loss_coef` above 0 on a dense (not mixture-of-experts) model",
    outcome="Usage error: the model has no routers; drop the flag",
)
def test_router_loss_on_a_dense_model_is_refused(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    argv = tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "run", router_aux_loss_coef=0.1)
    error = _error_of(capsys, argv)
    assert "--router_aux_loss_coef 0.1:" in error
    assert "has no mixture-of-experts routers; drop it" in error


@pytest.mark.numerics
def test_two_ranks_match_one_process_with_the_router_loss(tiny_moe_dir, chat_jsonl, tmp_path):
    """2 gloo ranks of 2 samples = one process accumulating 2 micro-batches of 2: each rank's
    micro-batch is one of the single process's, so even the load-balancing loss (not linear
    in its micro-batch) agrees, as do the expert loads summed over the ranks."""
    flags = dict(RUN, router_aux_loss_coef=0.5, learning_rate="1e-2", max_steps=4)
    flags["per_device_train_batch_size"] = 2
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert (
        main(tiny_sft(tiny_moe_dir, chat_jsonl, single, **flags, gradient_accumulation_steps=2))
        == 0
    )
    argv = tiny_sft(tiny_moe_dir, chat_jsonl, ddp, **flags, nproc_per_node=2, master_port=29533)
    assert main(argv) == 0
    terms = forward_terms(64, intermediate=32) + 2  # + the all-reduce of two ranks' sums
    for key in ("loss", "router_aux_loss", "router_entropy"):
        assert_close(logged(ddp, key), logged(single, key), terms=terms, what=key)
    # Step 1 routes the same tokens with the same weights: the same slots, summed over ranks.
    # (Later steps' weights differ by rounding, which may flip a near-tied top-k pick.)
    assert logged(ddp, "router_expert_load")[0] == logged(single, "router_expert_load")[0]
    adapter = "adapter_model.safetensors"
    assert_trained_weights_close(
        single / "final" / adapter, ddp / "final" / adapter, learning_rate=1e-2, steps=4
    )
