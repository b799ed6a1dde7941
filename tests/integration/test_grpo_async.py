"""`swiftlm rlhf --rlhf_type grpo --async_generate true`: each generation is sampled in the
background from the policy one generation older than the one it trains, with that policy's
log-probs as the importance ratio's old ones; with weights that never move it is the synchronous run;
a resumed run equals the straight one; what it cannot run is refused by name."""

import json

import pytest
from test_grpo import ADAPTER, ROWS, Crash, grpo, loss_size

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, forward_terms

STEPS = 4
# A learning rate whose AdamW steps (at most lr per weight) are below the float32 spacing of
# the tiny model's weights (~0.02 x 1.2e-7): the weights never change (0 is refused).
FROZEN = "1e-12"


# A reward that differs within almost every group from the first step on (the tiny model's
# completions all run to --max_completion_length, so a length reward would give every
# advantage 0 and no update at all): the share of distinct tokens.
DISTINCT_REWARD = """
def distinct(prompts, completions, completion_ids, **kwargs):
    return [len(set(ids)) / len(ids) for ids in completion_ids]
"""


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", ROWS)


@pytest.fixture
def distinct_reward(tmp_path):
    path = tmp_path / "distinct.py"
    path.write_text(DISTINCT_REWARD)
    return f"{path}:distinct"


def completions_by_step(run_dir) -> dict[int, list[tuple]]:
    """completions.jsonl: per step trained on, its (prompt, completion, reward) in order."""
    lines = (run_dir / "completions.jsonl").read_text().splitlines()
    by_step: dict[int, list[tuple]] = {}
    for row in map(json.loads, lines):
        by_step.setdefault(row["step"], []).append(
            (row["prompt"][-1]["content"], row["completion"], row["reward"])
        )
    return by_step


def run(model_dir, data, out, reward, **flags):
    common = dict(max_steps=STEPS, reward_funcs=reward, save_steps=100)
    assert main(grpo(model_dir, data, out, **{**common, **flags})) == 0
    return out


@pytest.mark.numerics
def test_each_generation_is_sampled_from_the_policy_one_generation_before(
    tiny_model_dir, prompts, distinct_reward, tmp_path
):
    """Generation 2 is sampled while step 1 trains, from the weights step 1 started with: the
    initial ones. So the async run's step-2 completions are those of a run that never moves
    its weights (a learning rate too small to change a float32 weight), and not those of the synchronous run, which samples step 2
    after step 1's update."""
    frozen = run(
        tiny_model_dir, prompts, tmp_path / "frozen", distinct_reward, learning_rate=FROZEN
    )
    sync = run(tiny_model_dir, prompts, tmp_path / "sync", distinct_reward, learning_rate="3e-1")
    out = tmp_path / "async"
    run(tiny_model_dir, prompts, out, distinct_reward, learning_rate="3e-1", async_generate="true")
    frozen, sync, ours = map(completions_by_step, (frozen, sync, out))
    assert ours[1] == sync[1] == frozen[1]  # the first generation is sampled as ever
    assert ours[2] == frozen[2]
    assert sync[2] != frozen[2]  # step 1's update changes what is sampled at step 2
    assert ours[3] != frozen[3]  # generation 3 samples the copy refreshed after step 1
    # From step 2 on, the trained policy is one update ahead of the one that sampled: the
    # importance ratio is logged, and it is no longer exactly 1.
    ratios = dict(zip(logged(out, "step"), logged(out, "importance_ratio"), strict=False))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "importance_ratio" not in rows[0]
    assert all("importance_ratio" in row for row in rows[1:STEPS])
    assert any(abs(row["importance_ratio"] - 1) > 1e-4 for row in rows[1:STEPS]), ratios
    # The engine sampled from the copy whose log-probs the trainer computed.
    assert max(logged(out, "logprob_mismatch")) < 1e-3


@pytest.mark.numerics
def test_with_frozen_weights_async_equals_the_synchronous_run(
    tiny_model_dir, prompts, distinct_reward, tmp_path
):
    """With weights that never move, sampling one generation early changes nothing: the same
    prompts, completions and rewards at every step, and the same losses (the old log-probs
    are the current ones, recomputed: a ratio of 1 up to the forward's rounding)."""
    sync = run(tiny_model_dir, prompts, tmp_path / "sync", distinct_reward, learning_rate=FROZEN)
    out = tmp_path / "async"
    run(tiny_model_dir, prompts, out, distinct_reward, learning_rate=FROZEN, async_generate="true")
    assert completions_by_step(out) == completions_by_step(sync)
    size, terms = loss_size(sync), forward_terms(64)
    assert_close(logged(out), logged(sync), terms=terms, magnitude=size)


@pytest.mark.numerics
def test_a_crashed_async_run_resumed_equals_an_uninterrupted_one(
    tiny_model_dir, prompts, distinct_reward, tmp_path, monkeypatch
):
    """A checkpoint at step 2 holds the generation sampled in the background for step 3; the
    resumed run trains step 3 on it and launches step 4's from its own weights."""
    from swiftlm.methods.rl.grpo import GRPO

    flags = dict(learning_rate="3e-2", async_generate="true", save_steps=2)
    straight = run(tiny_model_dir, prompts, tmp_path / "straight", distinct_reward, **flags)
    real_loss, calls = GRPO.loss, {"n": 0}

    def crashing_loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash  # killed during step 3, after the step-2 checkpoint
        return real_loss(self, model, batch)

    monkeypatch.setattr(GRPO, "loss", crashing_loss)
    argv = grpo(tiny_model_dir, prompts, tmp_path / "resumed", max_steps=STEPS,
                reward_funcs=distinct_reward, **flags)  # fmt: skip
    with pytest.raises(Crash):
        main(argv)
    monkeypatch.setattr(GRPO, "loss", real_loss)
    assert main([*argv, "--resume_from_checkpoint", "auto"]) == 0
    resumed = tmp_path / "resumed"
    assert completions_by_step(resumed) == completions_by_step(straight)
    # The background thread's forwards run beside the training's on the same cores, so the
    # kernels' thread splits (and roundings) may differ between two runs: bounds, not bits.
    assert_trained_weights_close(
        straight / ADAPTER, resumed / ADAPTER, learning_rate=3e-2, steps=STEPS
    )
    size, terms = loss_size(straight), forward_terms(64)
    assert_close(logged(resumed)[-2:], logged(straight)[-2:], terms=terms, magnitude=size)


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type grpo --async_generate true` with several ranks, vLLM "
    "rollouts or a quantized base",
    outcome="Exit 2 before anything loads, naming the flag and --async_generate",
)
@pytest.mark.parametrize(
    "flags",
    [{"nproc_per_node": 2}, {"infer_backend": "vllm"}, {"quant_method": "bnb", "quant_bits": 4}],
)
def test_what_async_generation_cannot_run_is_refused(
    tiny_model_dir, prompts, tmp_path, capsys, flags
):
    argv = grpo(tiny_model_dir, prompts, tmp_path / "x", async_generate="true", **flags)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--{next(iter(flags))} " in err and "not available with --async_generate" in err
