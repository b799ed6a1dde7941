"""Run directories under torchrun (2 gloo ranks on CPU, launched through the real CLI).

Rank 0 settles the run directory once and the other ranks follow it: an --add_version folder
is the same on every rank and, after torchrun restarts the workers (--max_restarts), the
restarted ones resume in it; a used --output_dir is refused, on a restart too, and the error
reaches the user.
The launches and the fault injection are test_elastic's.
"""

from test_elastic import Launch, adapter


def test_a_restart_resumes_in_the_same_add_version_folder(tiny_model_dir, chat_jsonl, tmp_path):
    data = ["--model", str(tiny_model_dir), "--dataset", str(chat_jsonl)]
    # Micro-batch 7 is the first of step 4 on rank 1: step-2 is complete, step-4 not written.
    flags = ["--add_version", "true", "--max_restarts", "1"]
    killed = Launch(tmp_path, "versioned", 29561, *data, *flags, fault="kill:7")
    code, output = killed.wait()
    assert code == 0, output[-3000:]
    versions = list(killed.run_dir.iterdir())
    assert len(versions) == 1 and versions[0].name.startswith("v0-"), versions
    assert f"resumed from {versions[0] / 'checkpoints' / 'step-2'} at step 2" in output, output
    assert adapter(versions[0])  # the restarted workers finished the run there


def test_a_used_output_dir_is_refused_under_torchrun(tiny_model_dir, chat_jsonl, tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.yaml").write_text("model: {}\n")
    (used / "metrics.jsonl").write_text("")
    data = ["--model", str(tiny_model_dir), "--dataset", str(chat_jsonl)]
    # A restart after the refusal is no first attempt's continuation: refused again.
    code, output = Launch(tmp_path, "used", 29562, *data, "--max_restarts", "1").wait()
    assert code != 0
    assert f"--output_dir {used} holds an earlier run" in output, output[-3000:]
    assert "--overwrite_output_dir true to delete it" in output
    assert sorted(p.name for p in used.iterdir()) == ["config.yaml", "metrics.jsonl"]
