"""Per-sample metrics, extraction rules and task files of `swiftlm eval`."""

import json

import pytest

from swiftlm.errors import ConfigError
from swiftlm.evaluation.generation import (
    answer_match,
    bleu,
    chrf,
    exact_match,
    extractor,
    normalize_answer,
    numeric_match,
    rouge_l,
)
from swiftlm.evaluation.judge import Verdict, _verdict, parse_verdict
from swiftlm.evaluation.task_file import kind_of_row, load_tasks, quick_suite
from swiftlm.evaluation.tasks import Sample


def sample(reference=None, answers=()):
    return Sample("x:1", [{"role": "user", "content": "q"}], reference, tuple(answers))


def test_normalization_follows_squad():
    assert normalize_answer("  The Eiffel-Tower, in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("ａｎ apple") == "apple"  # NFKC folds full-width letters


def test_exact_and_answer_match():
    s = sample("The capital of Peru is Lima.", ["Lima"])
    assert exact_match("lima", s) == 1.0 and exact_match("It is Lima.", s) == 0.0
    assert answer_match("The capital of Peru is Lima.", s) == 1.0
    assert answer_match("Limassol is in Cyprus.", s) == 0.0  # whole words only
    assert answer_match("anything", sample("Rome")) == 0.0
    assert answer_match("I think it's rome", sample("Rome")) == 1.0


def test_numeric_match_reads_the_last_number_and_gsm8k_answers():
    s = sample("She pays 3 + 4 = 7 dollars.\n#### 1,200")
    assert numeric_match("so the total is 1200", s) == 1.0
    assert numeric_match("1,200.0 dollars", s) == 1.0
    assert numeric_match("1,200 then 7", s) == 0.0
    assert numeric_match("no number", s) == 0.0


def test_rouge_and_sacrebleu_metrics_against_the_libraries():
    import sacrebleu
    from rouge_score import rouge_scorer

    ref, pred = "the cat sat on the mat", "the cat lay on the mat"
    s = sample(ref)
    expected = rouge_scorer.RougeScorer(["rougeL"]).score(ref, pred)["rougeL"].fmeasure
    assert rouge_l(pred, s) == pytest.approx(expected) and 0 < expected < 1
    assert bleu(pred, s) == pytest.approx(sacrebleu.sentence_bleu(pred, [ref]).score / 100)
    assert chrf(pred, s) == pytest.approx(sacrebleu.sentence_chrf(pred, [ref]).score / 100)
    assert rouge_l(ref, s) == pytest.approx(1.0) and chrf(ref, s) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "rule, text, expected",
    [
        ("strip", "  Paris \n", "Paris"),
        ("first_line", "\n\nParis\nis the capital", "Paris"),
        ("last_number", "3 apples and 1,250 pears", "1250"),
        ("last_number", "none", ""),
        ("after:Answer:", "reasoning... Answer: 42", "42"),
        ("regex:\\(([A-D])\\)", "I pick (C) because", "C"),
        ("regex:\\(([A-D])\\)", "no choice", ""),
    ],
)
def test_extraction_rules(rule, text, expected):
    assert extractor(rule, "test")(text) == expected


def test_bad_extraction_rule_names_the_place():
    with pytest.raises(ConfigError, match="task t: unknown extraction 'last_word'"):
        extractor("last_word", "task t")
    with pytest.raises(ConfigError, match="not a valid regex"):
        extractor("regex:(", "task t")


def test_kind_of_row_from_columns():
    assert kind_of_row({"text": "a"}) == "perplexity"
    assert kind_of_row({"messages": []}) == "generation"
    assert kind_of_row({"question": "q", "choices": ["a", "b"], "answer": 0}) == "multiple_choice"
    assert kind_of_row({"prompt": "def f():", "test": "...", "entry_point": "f"}) == "code"


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_task_yaml_sets_metrics_extraction_and_reads_data_relative_to_it(tmp_path):
    write(tmp_path / "math.jsonl", [{"query": "2+2?", "response": "4"}] * 3)
    (tmp_path / "math.yaml").write_text(
        "task: arith\ndataset: math.jsonl\nmetrics: [numeric_match]\nextraction: last_number\n"
        "max_new_tokens: 16\nsystem: Answer with a number.\n"
    )
    (task,) = load_tasks([str(tmp_path / "math.yaml")], limit=2, placeholders={})
    assert (task.name, task.kind, task.metrics) == ("arith", "generation", ("numeric_match",))
    assert (task.extraction, task.max_new_tokens, len(task.samples)) == ("last_number", 16, 2)
    assert task.samples[0].reference == "4" and task.samples[0].id.endswith("math.jsonl:1")
    assert len(task.source_sha256) == 64


def test_question_answer_rows_are_generation_tasks(tmp_path):
    path = write(
        tmp_path / "gsm.jsonl",
        [{"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"}],
    )
    (task,) = load_tasks([str(path)], None, {})
    assert task.kind == "generation" and task.samples[0].reference.endswith("#### 7")
    assert task.samples[0].prompt == [
        {"role": "user", "content": "Ann has 3 apples and buys 4. How many?"}
    ]
    assert numeric_match("so she has 7 apples", task.samples[0]) == 1.0


@pytest.mark.bad_input(
    input="`swiftlm eval` task YAML with an unknown key, kind or metric, or no dataset",
    outcome="Error naming the YAML file and the key, with the accepted ones",
)
def test_bad_task_yaml_is_refused_with_the_file_and_key(tmp_path):
    write(tmp_path / "d.jsonl", [{"query": "q", "response": "a"}])
    cases = {
        "dataset: d.jsonl\nmetric: [rouge_l]\n": "unknown key metric",
        "dataset: d.jsonl\nkind: essay\n": "kind 'essay' is not one of",
        "dataset: d.jsonl\nmetrics: [accuracy]\n": "unknown metric accuracy",
        "task: x\n": "no `dataset:` key",
        "dataset: d.jsonl\nkind: multiple_choice\ntemplate: 'Q: {q}'\n": "cannot be filled",
        "dataset: d.jsonl\nkind: multiple_choice\ntemplate: 'Answer:'\n": "has no {question}",
    }
    for text, message in cases.items():
        (tmp_path / "t.yaml").write_text(text)
        with pytest.raises(ConfigError, match=message) as info:
            load_tasks([str(tmp_path / "t.yaml")], None, {})
        assert str(tmp_path / "t.yaml") in str(info.value)


@pytest.mark.bad_input(
    input="`swiftlm eval --eval_dataset` rows without a reference, with bad choices or answers",
    outcome="Every bad row listed as `file:line: reason` before the model loads",
)
def test_bad_rows_are_listed_by_file_and_line(tmp_path):
    from swiftlm.data.loading import DataValidationError

    path = write(
        tmp_path / "mc.jsonl",
        [
            {"question": "q", "choices": ["a", "b"], "answer": 1},
            {"question": "q", "choices": ["a"], "answer": 0},
            {"question": "q", "choices": ["a", "b"], "answer": "E"},
        ],
    )
    with pytest.raises(DataValidationError) as info:
        load_tasks([str(path)], None, {})
    message = str(info.value)
    assert f"{path}:2: 'choices' must be a list of at least 2 strings" in message
    assert f"{path}:3: 'answer' 'E' is outside the 2 choices" in message
    path = write(tmp_path / "gen.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataValidationError, match="gen.jsonl:1: no reference answer"):
        load_tasks([str(path)], None, {})


def test_quick_suite_is_packaged_and_held_out_from_the_default_training_data():
    tasks = quick_suite({"{{NAME}}": "Swifty", "{{AUTHOR}}": "the swiftlm team"})
    by_name = {t.name: t for t in tasks}
    assert set(by_name) == {
        "humaneval_quick",
        "general_qa_eval",
        "self_cognition_probes",
        "heldout_text",
    }
    assert len(by_name["humaneval_quick"].samples) == 21
    assert by_name["self_cognition_probes"].samples[0].answers == ("Swifty",)
    from swiftlm.data.sources import builtin_dataset_path

    trained = set()
    for name in ("swiftlm/general-qa", "swiftlm/self-cognition"):
        for line in builtin_dataset_path(name).read_text().splitlines():
            trained.add(json.loads(line)["messages"][0]["content"].lower())
    for task in ("general_qa_eval", "self_cognition_probes"):
        questions = [s.prompt[-1]["content"].lower() for s in by_name[task].samples]
        assert not set(questions) & trained


def test_judge_verdicts_are_read_from_both_orders():
    assert parse_verdict("A is clearer. [[A]]") == "A" and parse_verdict("[[B]] ... [[C]]") == "C"
    assert parse_verdict("no verdict") is None
    assert _verdict("[[A]]", "[[B]]") == Verdict("win", "win", 0, ("[[A]]", "[[B]]"))
    biased = _verdict("[[A]]", "[[A]]")  # always the first answer: the model wins once
    assert biased.scores() == {
        "judge_win_rate": 0.5,
        "judge_consistency": 0.0,
        "judge_unparsed": 0.0,
    }
    unread = _verdict("?", "[[C]]").scores()
    assert unread == {"judge_win_rate": 0.5, "judge_unparsed": 0.5}  # no consistency to claim
