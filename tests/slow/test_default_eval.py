"""`swiftlm eval` on the real default model: the default job's fine-tune against the packaged
base on the held-out probes and questions of swiftlm/quick, compared sample by sample."""

import json

import pytest

from swiftlm.cli.main import main

pytestmark = pytest.mark.slow

TASKS = ["swiftlm/self-cognition-probes", "swiftlm/general-qa-eval", "swiftlm/heldout-text"]


def test_fine_tune_learns_its_name_keeps_its_knowledge_and_saw_none_of_the_tests(tmp_path):
    run = tmp_path / "default"
    names = ["--model_name", "Quokka", "--model_author", "Acme Labs"]
    assert main(["sft", "--output_dir", str(run), "--report_to", "none", *names]) == 0
    base = tmp_path / "base"
    # The base is asked the same probes: is its name Quokka? (It has no reason to say so.)
    assert main(["eval", "--eval_dataset", *TASKS, "--eval_output_dir", str(base), *names]) == 0
    # The run's name and author are inherited, and its training data is checked for overlap.
    # Written to the run's own eval/<timestamp> folder, where --compare finds it.
    assert main(["eval", "--ckpt_dir", str(run), "--eval_dataset", *TASKS]) == 0
    (tuned,) = (run / "eval").iterdir()
    a = json.loads((base / "summary.json").read_text())["tasks"]
    b = json.loads((tuned / "summary.json").read_text())
    assert a["self_cognition_probes"]["metrics"]["answer_match"]["mean"] <= 0.1
    assert b["tasks"]["self_cognition_probes"]["metrics"]["answer_match"]["mean"] >= 0.75
    qa_base = a["general_qa_eval"]["metrics"]["answer_match"]["mean"]
    qa_tuned = b["tasks"]["general_qa_eval"]["metrics"]["answer_match"]["mean"]
    assert qa_tuned >= qa_base - 0.15, (qa_base, qa_tuned)
    contamination = b["contamination"]
    assert contamination["training_data"] == ["swiftlm/self-cognition", "swiftlm/general-qa"]
    assert all(t["contaminated"] == 0 for t in contamination["tasks"].values())

    out = tmp_path / "compare"
    assert main(["eval", "--compare", str(base), str(run), "--eval_output_dir", str(out)]) == 0
    rows = json.loads((out / "compare.json").read_text())["comparisons"]
    probes = next(
        r for r in rows if (r["task"], r["metric"]) == ("self_cognition_probes", "answer_match")
    )
    assert probes["test"] == "mcnemar-exact" and probes["p_value"] < 0.01 and probes["low"] > 0
