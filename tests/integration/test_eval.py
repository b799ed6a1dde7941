"""`swiftlm eval` end to end on the tiny model: perplexity against transformers, multiple
choice against an independent log-likelihood, generation records, the manifest, a served
endpoint against the local model, --compare, contamination, judges, and bad input."""

import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from serve_helpers import free_port

from conftest import build_tiny_llama, build_tokenizer, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, forward_terms, rounding_bound

TEXTS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Hello! How can I help you today? Tell me a story about a cat. " * 3},
    {"text": "system user assistant tool answer question data model train loss"},
]
QA = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Who are you?", "I am a helpful assistant made by the swiftlm team."),
        ("Tell me a story about a cat.", "The quick brown fox jumps over the lazy dog."),
        ("How can I help you today?", "Hello!"),
    ]
]
CHOICES = [
    {
        "question": "What is the capital of France?",
        "choices": ["Paris", "Rome", "data"],
        "answer": 0,
    },
    {"question": "Who are you?", "choices": ["a cat", "an assistant"], "answer": "B"},
    {"question": "1 2 3 4 5", "choices": ["6", "fox", "loss model"], "answer": 0},
]


def evaluate(out: Path, *args) -> dict:
    assert main(["eval", *map(str, args), "--eval_output_dir", str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The tiny model and tokenizer as plain transformers objects, in fp32: the independent
    side of the numeric checks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def evaluate_fp32(out: Path, model_dir: Path, data: Path) -> dict:
    return evaluate(out, "--model", model_dir, "--eval_dataset", data, "--torch_dtype", "float32")


@pytest.mark.numerics
def test_perplexity_equals_transformers(tiny_model_dir, reference, tmp_path):
    data = write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    summary = evaluate_fp32(tmp_path / "out", tiny_model_dir, data)
    model, tokenizer = reference
    total_nll = total_tokens = 0.0
    for row, record in zip(TEXTS, records(tmp_path / "out"), strict=True):
        ids = tokenizer(row["text"], return_tensors="pt").input_ids
        with torch.no_grad():
            mean_nll = model(input_ids=ids, labels=ids).loss.item()
        assert record["tokens"] == ids.shape[1] - 1
        terms = forward_terms(tokens=ids.shape[1])  # the text's own length
        assert_close(record["scores"]["nll_per_token"], mean_nll, terms=terms, what="nll")
        total_nll += mean_nll * (ids.shape[1] - 1)
        total_tokens += ids.shape[1] - 1
    perplexity = summary["tasks"]["texts"]["metrics"]["perplexity"]
    # exp turns the mean NLL's absolute rounding into the same relative one
    expected = math.exp(total_nll / total_tokens)
    nll_bound = rounding_bound(total_nll / total_tokens, forward_terms(tokens=64))
    assert abs(perplexity["mean"] - expected) <= expected * nll_bound
    assert perplexity["low"] <= perplexity["mean"] <= perplexity["high"]


@pytest.mark.numerics
def test_a_text_longer_than_the_context_is_scored_in_windows(reference):
    """Windows overlap by one token, so every token after the first is predicted once."""
    from swiftlm.evaluation.loglik import text_nll

    model, tokenizer = reference
    text = TEXTS[1]["text"]
    n = len(tokenizer(text)["input_ids"])
    ids = tokenizer(text)["input_ids"]
    (windowed,) = text_nll(model, tokenizer, [text], max_length=9)
    expected = 0.0
    for start in range(0, len(ids) - 1, 8):  # 9-token windows sharing one token
        window = torch.tensor([ids[start : start + 9]])
        with torch.no_grad():
            expected += model(input_ids=window, labels=window).loss.item() * (window.shape[1] - 1)
    assert windowed.tokens == n - 1 and n > 30
    assert_close(windowed.nll, expected, terms=forward_terms(tokens=n), what="windowed nll")


@pytest.mark.numerics
def test_multiple_choice_picks_the_likeliest_choice(tiny_model_dir, reference, tmp_path):
    data = write_jsonl(tmp_path / "mc.jsonl", CHOICES)
    summary = evaluate_fp32(tmp_path / "out", tiny_model_dir, data)
    model, tokenizer = reference
    correct = 0
    for row, record in zip(CHOICES, records(tmp_path / "out"), strict=True):
        context = f"Question: {row['question']}\nAnswer:"
        expected = []
        for choice in row["choices"]:
            # independent: score the continuation token by token with log_softmax
            ids = tokenizer(context + " " + choice)["input_ids"]
            start = len(tokenizer(context)["input_ids"])
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
            expected.append(sum(logits[i - 1, ids[i]].item() for i in range(start, len(ids))))
        # a batched forward against one per choice (short prompts, under 64 tokens)
        terms = forward_terms(tokens=64)
        assert_close(record["choice_logprobs"], expected, terms=terms, what="choice logprobs")
        picked = max(range(len(expected)), key=expected.__getitem__)
        label = row["answer"] if isinstance(row["answer"], int) else "AB".index(row["answer"])
        correct += picked == label
        assert record["scores"]["acc"] == float(picked == label)
    assert summary["tasks"]["mc"]["metrics"]["acc"]["mean"] == pytest.approx(correct / 3)


def test_generation_records_summary_and_manifest(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    args = [
        "--model",
        tiny_model_dir,
        "--eval_dataset",
        data,
        "--max_new_tokens",
        "12",
        "--seed",
        "3",
    ]
    summary = evaluate(tmp_path / "a", *args)
    evaluate(tmp_path / "b", *args)
    first, second = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["prediction"] for r in first] == [r["prediction"] for r in second]  # to the sample
    assert [r["id"] for r in first] == [f"{data}:{i}" for i in range(1, 5)]
    assert first[0]["reference"] == "The capital of France is Paris."
    assert set(first[0]["scores"]) == {"exact_match", "answer_match", "rouge_l", "chrf"}
    metrics = summary["tasks"]["qa"]["metrics"]
    for value in metrics.values():
        assert value["low"] <= value["mean"] <= value["high"] and value["n"] == 4
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    from swiftlm.evaluation.manifest import weights_sha256

    assert manifest["model"]["base_sha256"] == weights_sha256(str(tiny_model_dir))
    assert manifest["seed"] == 3 and manifest["sampling"]["max_new_tokens"] == 12
    task = manifest["tasks"]["qa"]
    assert task["extraction"] == "strip" and task["prompt_format"] == "chat"
    import hashlib

    assert task["source_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert manifest["model"]["chat_template_sha256"] and manifest["versions"]["torch"]
    # the saved config reruns the same evaluation
    rerun = tmp_path / "rerun"
    assert main(["eval", str(tmp_path / "a" / "config.yaml"), "--eval_output_dir", str(rerun)]) == 0
    assert [r["prediction"] for r in records(rerun)] == [r["prediction"] for r in first]


def start_deploy(model_dir: Path):
    port = free_port()
    command = [sys.executable, "-m", "swiftlm", "deploy", "--model", str(model_dir)]
    command += ["--port", str(port), "--served_model_name", "tiny"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            time.sleep(0.3)
    server.kill()
    raise AssertionError("swiftlm deploy did not start")


def test_served_endpoint_gives_the_local_predictions(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "qa.jsonl", QA * 2)
    flags = ["--eval_dataset", data, "--max_new_tokens", "16", "--system", "Be brief."]
    local = evaluate(tmp_path / "local", "--model", tiny_model_dir, *flags)
    server, url = start_deploy(tiny_model_dir)
    try:
        served = evaluate(tmp_path / "served", "--eval_url", url, *flags)
    finally:
        server.terminate()
        server.wait(timeout=60)
    predictions = [r["prediction"] for r in records(tmp_path / "local")]
    assert predictions == [r["prediction"] for r in records(tmp_path / "served")]
    assert len(set(predictions)) > 1  # not one degenerate answer
    assert local["tasks"]["qa"]["metrics"] == served["tasks"]["qa"]["metrics"]
    manifest = json.loads((tmp_path / "served" / "manifest.json").read_text())
    assert manifest["model"] == {"description": f"tiny at {url}", "url": url, "model": "tiny"}


def test_compare_pairs_two_models_on_the_same_samples(tiny_model_dir, tmp_path, capsys):
    other = tmp_path / "other-model"
    tokenizer = build_tokenizer(other)
    build_tiny_llama(other, len(tokenizer), seed=7)
    data = write_jsonl(tmp_path / "mc.jsonl", CHOICES * 4)
    evaluate(tmp_path / "a", "--model", tiny_model_dir, "--eval_dataset", data)
    evaluate(tmp_path / "b", "--model", other, "--eval_dataset", data, "--eval_limit", "10")
    capsys.readouterr()
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "eval",
                "--compare",
                str(tmp_path / "a"),
                str(tmp_path / "b"),
                "--eval_output_dir",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    result = json.loads((out / "compare.json").read_text())
    a = {r["id"]: r["scores"]["acc"] for r in records(tmp_path / "a")}
    b = {r["id"]: r["scores"]["acc"] for r in records(tmp_path / "b")}
    shared = sorted(b)
    expected = sum(b[i] - a[i] for i in shared) / len(shared)
    (row,) = [r for r in result["comparisons"] if r["metric"] == "acc"]
    assert row["n"] == 10 and row["diff"] == pytest.approx(expected)
    assert row["test"] == "mcnemar-exact" and 0 <= row["p_value"] <= 1
    assert result["tasks"] == [{"task": "mc", "matched": 10, "only_a": 2, "only_b": 0}]
    assert "acc" in printed and "mcnemar-exact" in printed


def test_contamination_flags_an_evaluation_sample_seen_in_training(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    train = write_jsonl(tmp_path / "train.jsonl", [QA[1], {"text": "unrelated words " * 10}])
    summary = evaluate(
        tmp_path / "out",
        "--model",
        tiny_model_dir,
        "--eval_dataset",
        data,
        "--max_new_tokens",
        "4",
        "--dataset",
        train,
        "--contamination_ngram",
        "8",
    )
    task = summary["contamination"]["tasks"]["qa"]
    assert task["contaminated"] == 1
    items = json.loads((tmp_path / "out" / "contamination.json").read_text())["items"]["qa"]
    assert [i["id"].endswith(":2") for i in items if i["contaminated"]] == [True]


class PositionBiasedJudge(BaseHTTPRequestHandler):
    """A judge that always prefers the first answer it reads: maximally inconsistent."""

    def do_GET(self):
        self._reply({"data": [{"id": "judge"}]})

    def do_POST(self):
        length = int(self.headers["Content-Length"])
        json.loads(self.rfile.read(length))
        self._reply({"choices": [{"message": {"content": "Assistant A is better. [[A]]"}}]})

    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_judge_swaps_positions_and_measures_consistency(tiny_model_dir, tmp_path):
    rows = [{**row, "baseline": "A baseline answer."} for row in QA]
    write_jsonl(tmp_path / "judged.jsonl", rows)
    (tmp_path / "judged.yaml").write_text("task: judged\ndataset: judged.jsonl\nkind: judge\n")
    server = HTTPServer(("127.0.0.1", 0), PositionBiasedJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        summary = evaluate(
            tmp_path / "out",
            "--model",
            tiny_model_dir,
            "--eval_dataset",
            tmp_path / "judged.yaml",
            "--judge_url",
            url,
            "--max_new_tokens",
            "4",
        )
    finally:
        server.shutdown()
    metrics = summary["tasks"]["judged"]["metrics"]
    assert metrics["judge_win_rate"]["mean"] == 0.5  # wins as A, loses as B
    assert metrics["judge_consistency"]["mean"] == 0.0
    first = records(tmp_path / "out")[0]["judge"]
    assert first["model_first"] == "win" and first["model_second"] == "loss"
    assert first["replies"] == ["Assistant A is better. [[A]]"] * 2


@pytest.mark.bad_input(
    input="`swiftlm eval --eval_url` pointing at no server, or a judge task without --judge_url",
    outcome="Error naming the URL (is it running, does it end with /v1?) or the missing flag",
)
def test_unreachable_endpoint_and_missing_judge_are_named(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["eval", "--eval_url", url, "--eval_dataset", str(data)]) == 1
    assert f"--eval_url {url}: cannot reach the server" in capsys.readouterr().err
    write_jsonl(tmp_path / "j.jsonl", QA)
    (tmp_path / "j.yaml").write_text("dataset: j.jsonl\nkind: judge\n")
    assert (
        main(["eval", "--model", str(tiny_model_dir), "--eval_dataset", str(tmp_path / "j.yaml")])
        == 2
    )
    assert "--judge_url" in capsys.readouterr().err


@pytest.mark.bad_input(
    input="`swiftlm eval` without --eval_dataset, --compare with a model, or two folders "
    "that share no samples",
    outcome="Error saying what to give, before any model loads",
)
def test_eval_flag_rules(tmp_path, capsys):
    assert main(["eval"]) == 2
    assert "--eval_dataset swiftlm/quick" in capsys.readouterr().err
    assert main(["eval", "--compare", "a", "b", "--eval_dataset", "x.jsonl"]) == 2
    assert "--compare reads two finished evaluations" in capsys.readouterr().err
    assert main(["eval", "--compare", "only-one"]) == 2
    argv = ["eval", "--eval_backend", "lm_eval", "--eval_url", "http://127.0.0.1:9/v1"]
    assert main([*argv, "--eval_dataset", "hellaswag"]) == 2
    assert "--eval_backend lm_eval runs on a local model" in capsys.readouterr().err
    for name, task in (("a", "t1"), ("b", "t2")):
        (tmp_path / name).mkdir()
        write_jsonl(
            tmp_path / name / "predictions.jsonl",
            [{"task": task, "id": "1", "scores": {"acc": 1.0}}],
        )
    assert main(["eval", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "share no samples" in capsys.readouterr().err


def test_a_reward_model_is_pointed_to_scoring(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = tmp_path / "rm"
    tokenizer = build_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(folder)
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    assert main(["eval", "--model", str(folder), "--eval_dataset", str(data)]) == 2
    assert "swiftlm infer --task score" in capsys.readouterr().err


@pytest.mark.bad_input(
    input="`swiftlm eval` sample whose prompt fills the model's context",
    outcome="Error naming the task, the sample (`file:line`) and the token counts",
)
def test_a_prompt_longer_than_the_context_names_its_sample(tiny_model_dir, tmp_path, capsys):
    rows = [*QA, {"query": "hello " * 5000, "response": "Hi"}]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    argv = ["eval", "--model", str(tiny_model_dir), "--eval_dataset", str(data)]
    assert main([*argv, "--eval_output_dir", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert f"task long, sample {data}:5: a prompt of" in error and "leaves no room" in error


def test_a_run_whose_training_data_moved_is_still_evaluated(tiny_model_dir, tmp_path, capsys):
    from conftest import tiny_sft

    train = write_jsonl(tmp_path / "train.jsonl", [QA[0], QA[1]] * 4)
    run = tmp_path / "run"
    assert main(tiny_sft(tiny_model_dir, train, run, max_steps=1)) == 0
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    out = tmp_path / "seen"
    flags = ["--eval_dataset", str(data), "--max_new_tokens", "4", "--contamination_ngram", "6"]
    summary = evaluate(out, "--ckpt_dir", run, *flags)
    assert summary["contamination"]["tasks"]["qa"]["contaminated"] == 2  # rows 1 and 2 trained on
    train.unlink()
    capsys.readouterr()
    summary = evaluate(tmp_path / "moved", "--ckpt_dir", run, *flags)
    assert "contamination" not in summary and summary["tasks"]["qa"]["n"] == 4
    assert "contamination check skipped: the run's training data" in capsys.readouterr().out
    # named explicitly, the same missing file is an error before the model loads
    argv = ["eval", "--ckpt_dir", str(run), *flags, "--dataset", str(train)]
    assert main([*argv, "--eval_output_dir", str(tmp_path / "named")]) == 1
    assert f"dataset file not found: {train}" in capsys.readouterr().err
    assert not (tmp_path / "named").exists()
