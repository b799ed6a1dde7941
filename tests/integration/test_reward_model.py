"""`swiftlm rlhf --rlhf_type rm` on a tiny model: the loss of a batch against an independent
computation, gradient accumulation, the margin column, a reward model that learns a held-out
preference (must-show), scoring with `swiftlm infer --task score` and `POST /v1/score`, and
the errors for a model without (or with) a reward head."""

import json
import math
import random

import pytest
import torch

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, backward_terms, forward_terms

ADAPTER = "final/adapter_model.safetensors"
# The learnable task: the same fact, said politely (chosen) or rudely (rejected), before or
# after the fact. Held-out pairs are about topics the training pairs never mention.
TOPICS = ["cat", "dog", "fox", "France", "Paris", "data", "model", "story", "train", "loss"]
POLITE = ["Thank you!", "Glad to help.", "Please ask again.", "Happy to help!"]
RUDE = ["Go away.", "Do not ask.", "I refuse.", "Stop it."]


# Every conversation here is shorter than 64 tokens (the tests' max_length).
TERMS = forward_terms(tokens=64)


def reward_size(model, ids: torch.Tensor) -> float:
    """What a reward's rounding is relative to (tests/tolerance.py): the score head's dot
    product with the last position's hidden state, sum_k |w_k| |h_k|, not the reward's own
    size (its terms cancel)."""
    head = next(m for n, m in model.named_modules() if n.split(".")[-1] == "score")
    ends = ("score.weight", "score.modules_to_save.default.weight")
    weight = next(p for n, p in model.named_parameters() if n.endswith(ends))
    seen = []
    handle = head.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return float(weight.detach().double().abs() @ seen[0][0, -1].double().abs())


def logged_reward_size(run_dir) -> float:
    """The largest |chosen| + |rejected| reward a run logged, and its loss: what the rounding
    of a logged loss or margin is relative to (a softplus of the margin has slope <= 1)."""
    chosen, rejected = logged(run_dir, "rewards/chosen"), logged(run_dir, "rewards/rejected")
    rewards = zip(chosen, rejected, strict=True)
    return max(abs(c) + abs(r) for c, r in rewards) + max(logged(run_dir))


def polite_pairs(seed: int, count: int, topics: list[str]) -> list[dict]:
    rng, rows = random.Random(seed), []
    for _ in range(count):
        topic, k = rng.choice(topics), rng.randint(0, 99)
        fact, first = f"The {topic} is number {k}.", rng.random() < 0.5
        chosen, rejected = (
            f"{extra} {fact}" if first else f"{fact} {extra}"
            for extra in (rng.choice(POLITE), rng.choice(RUDE))
        )
        rows.append({"prompt": f"Tell me about the {topic} {k}?", "chosen": chosen, "rejected": rejected})  # fmt: skip
    return rows


def conversations(pairs: list[dict]) -> list[dict]:
    """Each pair as two conversations to score, chosen first."""
    return [
        {
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p[side]},
            ]
        }  # fmt: skip
        for p in pairs
        for side in ("chosen", "rejected")
    ]


TRAIN = polite_pairs(0, 64, TOPICS[:7])
HELD_OUT = polite_pairs(1, 40, TOPICS[7:])


def rm(model_dir, data, out, **flags) -> list[str]:
    defaults = {"torch_dtype": "float32", "report_to": "none", "logging_steps": 1}
    argv = ["rlhf", "--rlhf_type", "rm", "--model", str(model_dir), "--dataset", str(data)]
    for name, value in {**defaults, **flags}.items():
        argv += [f"--{name}", str(value)]
    return [*argv, "--output_dir", str(out)]


@pytest.fixture(scope="module")
def polite_run(tiny_model_dir, tmp_path_factory):
    """A 12-step LoRA reward model of the polite task (run folder `polite-rm`)."""
    root = tmp_path_factory.mktemp("rm")
    data = write_jsonl(root / "polite.jsonl", TRAIN)
    flags = dict(max_steps=12, per_device_train_batch_size=8, learning_rate="5e-3", lora_dropout=0)
    assert main(rm(tiny_model_dir, data, root / "polite-rm", **flags)) == 0
    return root / "polite-rm"


@pytest.fixture(scope="module")
def held_out_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("held") / "held.jsonl", conversations(HELD_OUT))


def score_file(args: list[str], data, out) -> list[float]:
    assert main(["infer", "--task", "score", *args, "--val_dataset", str(data), "--result_path", str(out)]) == 0  # fmt: skip
    return [json.loads(line)["score"] for line in out.read_text().splitlines()]


def accuracy(scores: list[float]) -> float:
    return sum(c > r for c, r in zip(scores[::2], scores[1::2], strict=True)) / (len(scores) // 2)


def test_the_reward_model_ranks_held_out_pairs(polite_run, held_out_file, tiny_model_dir, tmp_path):  # fmt: skip
    """Must-show: after 12 steps on 64 pairs the model prefers the polite answer on 40 pairs
    about topics it never saw. Measured: 0.15 with the run's initial weights (seed 42), 1.0
    after training (also 1.0 with full fine-tuning)."""
    from transformers import AutoTokenizer, set_seed

    from swiftlm.engine.score import RewardScorer
    from swiftlm.models.loader import SEQUENCE_CLASSIFICATION, load_model

    set_seed(42)  # --seed's default: the head the run started from
    cpu, tokenizer = torch.device("cpu"), AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_model(str(tiny_model_dir), torch.float32, cpu, "sdpa", None, SEQUENCE_CLASSIFICATION, 0)  # fmt: skip
    scorer = RewardScorer(model, tokenizer)
    before = scorer.score_ids([scorer.encode(c["messages"]) for c in conversations(HELD_OUT)])
    assert accuracy(before) < 0.5
    losses = logged(polite_run)
    assert losses[-1] < 0.5 * losses[0]
    scores = score_file(["--ckpt_dir", str(polite_run)], held_out_file, tmp_path / "s.jsonl")
    assert accuracy(scores) >= 0.8
    assert "rlhf_type: rm" in (polite_run / "config.yaml").read_text()


def build_batch(model_dir, rows, train_type="lora"):
    """(method, collated batch, a reward model with random head and LoRA weights) for `rows`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.methods.base import Layout
    from swiftlm.methods.registry import METHODS
    from swiftlm.models.loader import SEQUENCE_CLASSIFICATION, load_model

    cfg = from_flat_dict(RLHFConfig, {"rlhf_type": "rm", "max_length": 64})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    method = METHODS["rm"](cfg, tokenizer)
    samples = method.encode([method.to_sample(row) for row in rows]).samples
    torch.manual_seed(0)
    model = load_model(
        str(model_dir), torch.float32, torch.device("cpu"), "sdpa", None,
        SEQUENCE_CLASSIFICATION, tokenizer.pad_token_id,
    )  # fmt: skip
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="SEQ_CLS")  # fmt: skip
    model = get_peft_model(model, lora)
    method.prepare_model(model, print)
    return method, method.collate(Layout([[s] for s in samples], False)), model, samples


@pytest.mark.numerics
def test_the_loss_of_a_batch_equals_an_independent_computation(tiny_model_dir):
    """Rewards from separate forwards of each conversation (no padding): the transformer's
    last hidden state times the score head, in float64; Bradley-Terry with margins by hand."""
    rows = [{**row, "margin": m} for row, m in zip(TRAIN[:3], (0, 1.5, -0.5), strict=True)]
    method, batch, model, samples = build_batch(tiny_model_dir, rows)
    loss, metrics = method.loss(model, batch)
    inner = model.base_model.model  # LlamaForSequenceClassification, LoRA layers in place
    head = inner.score.modules_to_save["default"].weight.double()

    def reward(ids) -> float:
        with torch.no_grad():
            hidden = inner.model(torch.tensor([ids])).last_hidden_state[0, -1].double()
        return (head @ hidden).item()

    expected, margins, correct, size = 0.0, 0.0, 0, 0.0
    for s, row in zip(samples, rows, strict=True):
        c, r = reward(s["chosen_input_ids"]), reward(s["rejected_input_ids"])
        expected += -math.log(1 / (1 + math.exp(-(c - r - row["margin"]))))
        margins, correct = margins + (c - r), correct + (c > r)
        for key in ("chosen_input_ids", "rejected_input_ids"):
            size += reward_size(inner, torch.tensor([s[key]]))
    # Padded batch against separate forwards: the loss sums softplus of the margins (slope
    # <= 1), so both carry the rewards' roundings, and the loss its own.
    assert_close(loss, expected, terms=TERMS, magnitude=size + expected, what="loss")
    assert_close(metrics["rewards/margins"], margins, terms=TERMS, magnitude=size, what="margins")
    assert metrics["rewards/accuracies"].item() == correct
    assert method.normalizer(batch) == 3
    assert batch["margin"].tolist() == [0, 1.5, -0.5]


@pytest.mark.numerics
def test_accumulating_4_micro_batches_of_1_equals_1_batch_of_4(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", TRAIN[:16])
    common = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0)
    runs = {
        "one": dict(per_device_train_batch_size=4, gradient_accumulation_steps=1),
        "four": dict(per_device_train_batch_size=1, gradient_accumulation_steps=4),
    }
    for name, flags in runs.items():
        assert main(rm(tiny_model_dir, data, tmp_path / name, **common, **flags)) == 0
    size = logged_reward_size(tmp_path / "one")
    for key in ("loss", "rewards/margins"):
        one, four = logged(tmp_path / "one", key), logged(tmp_path / "four", key)
        assert_close(four, one, terms=TERMS, magnitude=size, what=key)
    norms = logged(tmp_path / "one", "grad_norm")
    assert_close(logged(tmp_path / "four", "grad_norm"), norms, terms=backward_terms(64))
    # A count of margins above 0, none of them within rounding of 0.
    accuracies = logged(tmp_path / "one", "rewards/accuracies")
    assert logged(tmp_path / "four", "rewards/accuracies") == accuracies
    # The score head trains and is saved with the adapter (peft's SEQ_CLS modules_to_save).
    one, four = tmp_path / "one" / ADAPTER, tmp_path / "four" / ADAPTER
    assert_trained_weights_close(one, four, learning_rate=5e-3, steps=3)


def test_the_margin_column_raises_the_loss_of_the_same_rewards(tiny_model_dir, tmp_path):
    """Same initial weights, so the same first-step rewards: a margin of 2 on every pair asks
    for more, softplus(-(d - 2)) > softplus(-d), and the full run saves a loadable head."""
    flags = dict(max_steps=1, per_device_train_batch_size=8, train_type="full")
    for margin in (0, 2):
        data = write_jsonl(
            tmp_path / f"m{margin}.jsonl", [{**p, "margin": margin} for p in TRAIN[:8]]
        )
        assert main(rm(tiny_model_dir, data, tmp_path / f"m{margin}", **flags)) == 0
    d0, d2 = (logged(tmp_path / f"m{m}", "rewards/margins")[0] for m in (0, 2))
    assert d0 == d2  # the same forward of the same weights: bit for bit
    assert logged(tmp_path / "m2")[0] > logged(tmp_path / "m0")[0] + 0.1
    config = json.loads((tmp_path / "m2" / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["pad_token_id"] == 0


@pytest.mark.bad_input(
    input="`swiftlm rlhf --rlhf_type rm`: a `margin` that is not a finite number",
    outcome="`file:line` and that `margin` must be a number; the run does not start",
)
def test_a_bad_margin_is_refused_with_file_and_line(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "bad.jsonl", [{**TRAIN[0], "margin": 1}, {**TRAIN[1], "margin": "big"}])  # fmt: skip
    assert main(rm(tiny_model_dir, data, tmp_path / "run", max_steps=1)) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:2:" in err and "`margin` must be a number" in err
    assert not (tmp_path / "run" / "final").exists()


def test_scores_are_the_trained_model_s_rewards_and_full_runs_load_as_a_model(
    polite_run, tiny_model_dir, tmp_path
):
    """infer --task score merges the adapter (score head included): its scores equal the
    rewards of peft's unmerged adapter; a prompt/response row is scored like messages."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = conversations(HELD_OUT[:2])
    data = write_jsonl(tmp_path / "rows.jsonl", [*rows, {"prompt": HELD_OUT[0]["prompt"], "response": HELD_OUT[0]["chosen"]}])  # fmt: skip
    scores = score_file(["--ckpt_dir", str(polite_run)], data, tmp_path / "scores.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, pad_token_id=0)  # fmt: skip
    model = PeftModel.from_pretrained(base, polite_run / "final").eval()
    sizes = []
    for row, score in zip(rows, scores, strict=False):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            unmerged = model(input_ids=ids).logits[0, 0].item()
        # Merged (W + BA, a rounding of |W| + |BA|) and batched against unmerged and alone.
        sizes.append(reward_size(model, ids))
        assert_close(unmerged, score, terms=TERMS + 1, magnitude=sizes[-1], what="score")
    # The same ids either way; in one padded batch, rows of other lengths beside them.
    assert_close(scores[-1], scores[0], terms=TERMS, magnitude=sizes[0], what="prompt/response")


@pytest.mark.bad_input(
    input="`swiftlm infer --task score` on a model without a reward head, or `swiftlm infer` "
    "(generation) on a reward model",
    outcome="Error naming the model and the fix (train with --rlhf_type rm; use --task score)",
)
def test_the_task_must_match_the_model(polite_run, tiny_model_dir, held_out_file, tmp_path, capsys):  # fmt: skip
    score = ["infer", "--task", "score", "--val_dataset", str(held_out_file)]
    assert main([*score, "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{tiny_model_dir} has no reward head" in err and "--rlhf_type rm" in err
    assert main(["infer", "--ckpt_dir", str(polite_run), "--val_dataset", str(held_out_file)]) == 2
    assert "is a reward model" in capsys.readouterr().err
    assert main(["infer", "--task", "score", "--ckpt_dir", str(polite_run)]) == 2
    assert "--task score scores the conversations of --val_dataset" in capsys.readouterr().err


def test_pipeline_parallel_is_refused_before_the_model_loads(tiny_tokenizer):
    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.errors import ConfigError
    from swiftlm.methods.preference.reward_model import RewardModel

    cfg = from_flat_dict(RLHFConfig, {"rlhf_type": "rm", "pipeline_parallel_size": 2})
    with pytest.raises(ConfigError, match="--pipeline_parallel_size"):
        RewardModel(cfg, tiny_tokenizer)


@pytest.fixture(scope="module")
def score_client(polite_run):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from swiftlm.config import DeployConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.engine.score import load_scorer
    from swiftlm.serve.app import ServerSettings, scoring_app
    from swiftlm.serve.models import plan_deployment

    plan = plan_deployment(from_flat_dict(DeployConfig, {"ckpt_dir": str(polite_run)}))
    assert plan.reward_model and plan.served.base == "polite-rm"
    scorer = load_scorer(plan.spec, from_flat_dict(DeployConfig, {}).model)
    with TestClient(scoring_app(scorer, plan.served, ServerSettings())) as client:
        yield client, scorer


@pytest.mark.numerics
def test_the_score_route_scores_one_or_several_conversations(score_client):
    client, scorer = score_client
    rows = [r["messages"] for r in conversations(HELD_OUT[:2])]
    one = client.post("/v1/score", json={"model": "polite-rm", "messages": rows[0]})
    assert one.status_code == 200, one.text
    many = client.post("/v1/score", json={"model": "polite-rm", "input": rows}).json()
    assert many["object"] == "list" and many["model"] == "polite-rm"
    assert [d["index"] for d in many["data"]] == [0, 1, 2, 3]
    scores = [d["score"] for d in many["data"]]
    ids = [scorer.encode(m) for m in rows]
    assert scores == scorer.score_ids(ids)  # the same call on the same rows: bit for bit
    # Alone against in a padded batch of 4.
    size = reward_size(scorer.model, torch.tensor([ids[0]], device=scorer.device))
    assert_close(one.json()["data"][0]["score"], scores[0], terms=TERMS, magnitude=size)
    assert scores[0] > scores[1] and scores[2] > scores[3]  # polite above rude
    tokens = sum(len(scorer.encode(m)) for m in rows)
    assert many["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert client.get("/v1/models").json()["data"][0]["id"] == "polite-rm"


@pytest.mark.bad_input(
    input="`swiftlm deploy` of a reward model: a /v1/score body with both or neither of "
    "`messages`/`input`, a conversation not ending with an answer, an unknown model, or a "
    "generation request (/v1/chat/completions, /v1/completions)",
    outcome="400 (404 for the model) OpenAI error naming the field or the route to use",
)
def test_bad_score_requests_and_generation_get_openai_errors(score_client):
    client, _ = score_client
    question = [{"role": "user", "content": "Hi?"}]
    answered = [*question, {"role": "assistant", "content": "Hello."}]
    cases = [
        ({"model": "polite-rm"}, 400, "exactly one of 'messages'"),
        ({"model": "polite-rm", "messages": answered, "input": [answered]}, 400, "exactly one"),
        ({"model": "polite-rm", "input": [answered, question]}, 400, "'input.1'"),
        ({"model": "polite-rm", "messages": answered, "temperature": 1}, 400, "unknown field"),
        ({"model": "other", "messages": answered}, 404, "does not exist"),
    ]
    for body, status, message in cases:
        response = client.post("/v1/score", json=body)
        assert response.status_code == status, body
        assert message in response.json()["error"]["message"], body
    for route in ("/v1/chat/completions", "/v1/completions"):
        response = client.post(route, json={"model": "polite-rm", "messages": question})
        assert response.status_code == 400
        error = response.json()["error"]
        assert "is a reward model" in error["message"] and "/v1/score" in error["message"]
        assert error["type"] == "invalid_request_error"


def test_deploy_serves_a_reward_model_run_for_scoring(polite_run):
    """The real command: a reward model loads without a generation engine, scores, refuses to
    generate, and stops cleanly on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    pytest.importorskip("fastapi")
    from serve_helpers import free_port

    port = free_port()
    command = [sys.executable, "-m", "swiftlm", "deploy", "--ckpt_dir", str(polite_run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [*command, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env,
    )  # fmt: skip
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    try:
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.2)
            assert time.monotonic() < deadline
        messages = conversations(HELD_OUT[:1])
        body = {"model": "polite-rm", "input": [m["messages"] for m in messages]}
        data = httpx.post(f"{url}/v1/score", json=body, timeout=60).json()["data"]
        assert data[0]["score"] > data[1]["score"]
        chat = {"model": "polite-rm", "messages": messages[0]["messages"]}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 400
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()


def test_a_reward_adapter_is_not_served_beside_a_generating_model(polite_run, tiny_model_dir):
    from swiftlm.config import DeployConfig, parse_config
    from swiftlm.errors import ConfigError
    from swiftlm.serve.models import plan_deployment

    argv = ["--model", str(tiny_model_dir), "--adapters", f"rm={polite_run}"]
    with pytest.raises(ConfigError, match="serve it alone with --ckpt_dir"):
        plan_deployment(parse_config(DeployConfig, argv, "swiftlm deploy"))


def test_with_lora_the_score_head_trains_in_float32_beside_the_adapters(tiny_model_dir):
    """peft copies the new head in the frozen base's dtype; bf16 would round Adam's updates."""
    from transformers import AutoTokenizer

    from swiftlm.config import RLHFConfig
    from swiftlm.config.parse import from_flat_dict
    from swiftlm.methods.preference.reward_model import RewardModel
    from swiftlm.models.loader import SEQUENCE_CLASSIFICATION, load_model
    from swiftlm.tuners.setup import apply_tuner

    cfg = from_flat_dict(RLHFConfig, {"rlhf_type": "rm"})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cpu = torch.device("cpu")
    model = load_model(str(tiny_model_dir), torch.bfloat16, cpu, "sdpa", None, SEQUENCE_CLASSIFICATION, 0)  # fmt: skip
    model = apply_tuner(model, cfg.tuner, SEQUENCE_CLASSIFICATION)
    RewardModel(cfg, tokenizer).prepare_model(model, print)
    trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert any("score.modules_to_save" in n for n in trained)
    assert set(trained.values()) == {torch.float32}


@pytest.mark.numerics
def test_two_gloo_ranks_equal_one_process_under_ddp_and_fsdp2(tiny_model_dir, tmp_path):
    """The pair normalizer is summed over ranks before the forward; the score head (peft's
    modules_to_save) trains and saves under both wrappers."""
    data = write_jsonl(tmp_path / "pairs.jsonl", TRAIN[:16])
    steps = dict(max_steps=3, learning_rate="5e-3", lora_dropout=0, gradient_accumulation_steps=2)
    runs = {
        "single": dict(per_device_train_batch_size=4),
        "ddp": dict(per_device_train_batch_size=2, nproc_per_node=2, master_port=29811),
        "fsdp2": dict(per_device_train_batch_size=2, nproc_per_node=2, master_port=29812, fsdp="fsdp2"),
    }  # fmt: skip
    for name, flags in runs.items():
        assert main(rm(tiny_model_dir, data, tmp_path / name, **steps, **flags)) == 0, name
    size = logged_reward_size(tmp_path / "single")
    for name in ("ddp", "fsdp2"):
        for key in ("loss", "rewards/margins"):
            single, run = logged(tmp_path / "single", key), logged(tmp_path / name, key)
            # + the all-reduce of two ranks' sums
            assert_close(run, single, terms=TERMS + 2, magnitude=size, what=f"{name} {key}")
        a, b = tmp_path / "single" / ADAPTER, tmp_path / name / ADAPTER
        assert_trained_weights_close(a, b, learning_rate=5e-3, steps=3)
