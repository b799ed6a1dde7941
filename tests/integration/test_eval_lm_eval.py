"""`run_lm_eval` on swiftlm's engine gives what lm-eval's own HF backend gives, on the same model.

Two local lm-eval tasks written here (a `generate_until` one scored by exact_match, a
`multiple_choice` one scored by acc/acc_norm) run once through the engine and once through
`lm_eval.simple_evaluate(model="hf")`; metrics must be equal, per-sample log-likelihoods equal
to float rounding and generated texts identical (junk, from a random model, but the same junk).
"""

import json
import os
import textwrap

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

pytest.importorskip("lm_eval")

QUESTIONS = [
    "What is the capital of France?",
    "Who are you?",
    "Tell me a story about a cat.",
    "What is 1 2 3?",
    "Hello! How can I help you today?",
    "The quick brown fox",
    "system user assistant",
    "你好，请问",
    "What is the lazy dog?",
    "Answer the question: data model train",
]
GEN_ROWS = [{"question": q, "answer": "" if i % 2 else "Paris"} for i, q in enumerate(QUESTIONS)]
MC_ROWS = [
    {
        "question": f"{q} The answer is",
        "choices": ["Paris", "a cat", " the lazy dog", "1 2 3 4 5 6 7 8 9 0"][: 2 + i % 3],
        "label": i % 2,
    }
    for i, q in enumerate(QUESTIONS)
]

GEN_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", " cap"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
MC_YAML = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(folder, name, yaml_text, rows):
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    path = folder / f"{name}.yaml"
    path.write_text(yaml_text.format(data=data, cache=folder / "hf-datasets-cache"))
    return str(path)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    return [
        write_task(folder, "tiny_gen", GEN_YAML, GEN_ROWS),
        write_task(folder, "tiny_mc", MC_YAML, MC_ROWS),
    ]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from swiftlm.engine.build import build_engine

    engine = build_engine(
        str(tiny_model_dir), torch_dtype="float32", device="cpu", max_num_seqs=8, warmup=False
    )
    yield engine
    engine.shutdown()


def run_both(engine, model_dir, task_files, **options):
    """(swiftlm's results, lm-eval HF backend's results) on the same tasks and seeds."""
    import lm_eval

    from swiftlm.evaluation.lm_eval_bridge import resolve_tasks, run_lm_eval, task_manager

    ours = run_lm_eval(engine, task_files, batch_size=16, bootstrap_iters=0, **options)
    names, folders = resolve_tasks(task_files)
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        tasks=names,
        device="cpu",
        batch_size=4,  # other batches than ours: the answers must not depend on batching
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        task_manager=task_manager(names, folders),
        **options,
    )
    return ours, theirs


@pytest.fixture(scope="module")
def both_runs(engine, task_files, tiny_model_dir):
    return run_both(engine, tiny_model_dir, task_files)


def samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_metrics_equal_lm_eval_hf_backend(both_runs):
    from swiftlm.evaluation.lm_eval_bridge import flatten_results

    ours, theirs = both_runs
    flat = flatten_results(ours)
    assert set(flat["tiny_mc"]) == {"acc", "acc_norm"}
    assert set(flat["tiny_gen"]) == {"exact_match"}
    assert flat == flatten_results(theirs)


def test_loglikelihoods_match(both_runs):
    ours, theirs = both_runs
    rows = list(zip(samples(ours, "tiny_mc"), samples(theirs, "tiny_mc"), strict=True))
    assert len(rows) == len(MC_ROWS)
    for a, b in rows:
        assert len(a["resps"]) == len(b["resps"]) == len(a["doc"]["choices"])
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
        ):
            assert ll_a == pytest.approx(ll_b, abs=1e-4)
            assert greedy_a == greedy_b


def test_generated_texts_identical(both_runs):
    ours, theirs = both_runs
    ours_texts = [s["resps"][0][0] for s in samples(ours, "tiny_gen")]
    theirs_texts = [s["resps"][0][0] for s in samples(theirs, "tiny_gen")]
    assert len(ours_texts) == len(GEN_ROWS)
    assert ours_texts == theirs_texts
    assert any(ours_texts), "every answer is empty: the comparison would prove nothing"


def test_chat_template_and_fewshot_prompts_match(engine, task_files, tiny_model_dir):
    """With the chat template and few-shot turns, prompts (hence answers) are HF's too."""
    ours, theirs = run_both(
        engine, tiny_model_dir, task_files[:1], apply_chat_template=True, num_fewshot=2
    )
    ours_samples, theirs_samples = samples(ours, "tiny_gen"), samples(theirs, "tiny_gen")
    assert "<|im_start|>assistant" in ours_samples[0]["arguments"][0][0]
    assert [s["arguments"] for s in ours_samples] == [s["arguments"] for s in theirs_samples]
    assert [s["resps"] for s in ours_samples] == [s["resps"] for s in theirs_samples]


def test_rolling_loglikelihood_matches_hf(engine, tiny_model_dir):
    """Texts longer than a 24-token window are scored in disjoint rolling windows."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from swiftlm.evaluation.lm_eval_bridge import engine_lm

    texts = [" ".join(QUESTIONS), QUESTIONS[0], "The quick brown fox jumps over the lazy dog. " * 3]
    requests = [
        Instance("loglikelihood_rolling", {}, (text,), i, ("rolling", i, 1))
        for i, text in enumerate(texts)
    ]
    hf = HFLM(pretrained=str(tiny_model_dir), dtype="float32", device="cpu", max_length=24)
    ours = engine_lm(engine, max_length=24).loglikelihood_rolling(requests)
    assert ours == pytest.approx(hf.loglikelihood_rolling(requests), abs=1e-4)


def test_flatten_results_drops_filters_and_keeps_stderrs():
    from swiftlm.evaluation.lm_eval_bridge import flatten_results, flatten_stderrs

    results = {
        "results": {
            "t": {
                "alias": "t",
                "acc,none": 0.5,
                "acc_stderr,none": 0.1,
                "exact_match,strict-match": 0.25,
                "exact_match_stderr,strict-match": "N/A",
            }
        }
    }
    assert flatten_results(results) == {"t": {"acc": 0.5, "exact_match,strict-match": 0.25}}
    assert flatten_stderrs(results) == {"t": {"acc": 0.1, "exact_match,strict-match": None}}


def test_bad_task_names_are_clear_errors(engine, tmp_path):
    from swiftlm.errors import ConfigError
    from swiftlm.evaluation.lm_eval_bridge import run_lm_eval

    with pytest.raises(ConfigError, match="missing.yaml: not found"):
        run_lm_eval(engine, [str(tmp_path / "missing.yaml")])
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text(textwrap.dedent("dataset_path: json\n"))
    with pytest.raises(ConfigError, match="no `task:` name"):
        run_lm_eval(engine, [str(nameless)])
    with pytest.raises(ConfigError, match="'no_such_task_xyz'"):
        run_lm_eval(engine, ["no_such_task_xyz"])


def test_missing_lm_eval_names_the_extra(monkeypatch):
    import sys

    from swiftlm.errors import ConfigError
    from swiftlm.evaluation.lm_eval_bridge import require_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import` sees when not installed
    with pytest.raises(ConfigError, match=r"pip install 'swiftlm\[eval\]'"):
        require_lm_eval()


def test_swiftlm_eval_command_runs_lm_eval_tasks(both_runs, task_files, tiny_model_dir, tmp_path):
    """`swiftlm eval --eval_backend lm_eval`: lm-eval's metrics in summary.json as lm-eval
    computes them, and per-document records that the bootstrap and --compare read."""
    import json

    from swiftlm.cli.main import main
    from swiftlm.evaluation.lm_eval_bridge import flatten_results

    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_model_dir), "--torch_dtype", "float32"]
    argv += ["--eval_backend", "lm_eval", "--eval_dataset", *map(str, task_files)]
    assert main([*argv, "--eval_output_dir", str(out), "--seed", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    expected = flatten_results(both_runs[1])  # lm-eval's HF backend
    assert summary["lm_eval"]["metrics"] == expected
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 20 and {r["task"] for r in records} == {"tiny_gen", "tiny_mc"}
    for task, metrics in expected.items():
        for metric, value in metrics.items():
            assert summary["tasks"][task]["metrics"][metric]["mean"] == pytest.approx(value)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["backend"].startswith("lm_eval 0.4")
        and manifest["model"]["compute_dtype"] == "float32"
    )


def test_an_unknown_task_fails_before_the_model_loads(tmp_path, capsys):
    from swiftlm.cli.main import main

    argv = ["eval", "--model", str(tmp_path / "no-model"), "--eval_backend", "lm_eval"]
    assert main([*argv, "--eval_dataset", "no_such_task_xyz"]) == 2
    error = capsys.readouterr().err
    assert "lm-eval task 'no_such_task_xyz': not a task" in error  # not "no such model"
