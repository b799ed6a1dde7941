"""`--report_to swanlab`: an offline run logs every scalar under the run directory, beside
TensorBoard; no login ever prompts or reaches the network; a missing package or a bad
SWANLAB_MODE is a clear error before the model loads; resume continues the same run."""

import importlib.util

import pytest

from conftest import tiny_sft
from swiftlm.cli.main import main
from swiftlm.errors import ConfigError
from swiftlm.monitor.loggers import SwanlabLogger, check_loggers_installed, swanlab_mode

needs_swanlab = pytest.mark.skipif(
    importlib.util.find_spec("swanlab") is None, reason="needs the swanlab extra"
)


@pytest.fixture
def no_swanlab_login(tmp_path, monkeypatch):
    """No key anywhere swanlab looks: env, ./.swanlab, ./.env, the user's swanlab folder."""
    for name in ("SWANLAB_API_KEY", "SWANLAB_MODE", "SWANLAB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-home"))
    monkeypatch.chdir(tmp_path)


def swanlab_scalars(path) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] from an offline .swanlab record log (swanlab's own reader)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader, scalars = DataStoreReader(), {}
    reader.open(path)
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        if record.HasField("scalar"):
            scalar = record.scalar
            scalars.setdefault(scalar.key, []).append((scalar.step, scalar.value.number))
    reader.close()
    return scalars


@needs_swanlab
def test_swanlab_offline_logs_every_step_beside_tensorboard(
    tiny_model_dir, chat_jsonl, tmp_path, monkeypatch, no_swanlab_login
):
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with_wandb = importlib.util.find_spec("wandb") is not None  # all three at once
    out = tmp_path / "run"
    loggers = ["tensorboard", *(["wandb"] * with_wandb), "swanlab"]
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, max_steps=2, report_to=loggers)) == 0
    run_id = (out / "swanlab_run_id").read_text().strip()
    (log,) = (out / "swanlab").glob(f"run-*-{run_id}/run-{run_id}.swanlab")
    try:
        scalars = swanlab_scalars(log)
    except ImportError:  # another swanlab version's internals: the keys are in the file
        data = log.read_bytes()
        assert all(key in data for key in (b"loss", b"learning_rate")), data[:200]
    else:
        assert [step for step, _ in scalars["loss"]] == [1, 2]
        for key in ("grad_norm", "learning_rate", "tokens_per_second"):
            assert len(scalars[key]) == 2, key
    (config,) = (out / "swanlab").glob(f"run-*-{run_id}/files/config.yaml")
    assert "max_steps" in config.read_text()  # the run's config.yaml became swanlab's
    assert list((out / "tb").glob("events.out.tfevents.*")), "tensorboard ran beside swanlab"
    if with_wandb:
        assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), "wandb ran too"


@needs_swanlab
def test_without_a_key_swanlab_stays_offline_and_says_so(tmp_path, capsys, no_swanlab_login):
    assert swanlab_mode() == "offline"
    assert "no API key configured" in capsys.readouterr().out
    (tmp_path / "run").mkdir()
    logger = SwanlabLogger(tmp_path / "run", resume=False)  # no prompt, no network: returns
    logger.log({"loss": 1.5}, 1)
    logger.close()
    assert list((tmp_path / "run" / "swanlab").glob("run-*/run-*.swanlab"))


def test_a_mode_or_key_lets_swanlab_decide(monkeypatch, capsys, no_swanlab_login):
    monkeypatch.setenv("SWANLAB_MODE", "local")
    assert swanlab_mode() is None
    monkeypatch.delenv("SWANLAB_MODE")
    monkeypatch.setenv("SWANLAB_API_KEY", "a-key")
    assert swanlab_mode() is None
    assert capsys.readouterr().out == ""


@needs_swanlab
def test_a_resumed_run_continues_the_same_swanlab_run(tmp_path, monkeypatch, no_swanlab_login):
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for resume, step in ((False, 1), (True, 2)):
        logger = SwanlabLogger(run_dir, resume=resume)
        logger.log({"loss": 1.0 / step}, step)
        logger.close()
    run_id = (run_dir / "swanlab_run_id").read_text().strip()
    # Offline, each session is its own folder with the same run id: `swanlab sync` joins them.
    assert len(list((run_dir / "swanlab").glob(f"run-*-{run_id}/run-{run_id}.swanlab"))) == 2


def test_a_missing_swanlab_package_names_the_extra(
    tiny_model_dir, chat_jsonl, tmp_path, capsys, monkeypatch
):
    real_find_spec = importlib.util.find_spec

    def without_swanlab(name, *args):
        return None if name == "swanlab" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_swanlab)
    expected = "--report_to swanlab needs the swanlab package: pip install 'swiftlm[swanlab]'"
    with pytest.raises(ConfigError, match=r"pip install 'swiftlm\[swanlab\]'"):
        check_loggers_installed(["tensorboard", "swanlab"])
    out = tmp_path / "run"
    argv = tiny_sft(tiny_model_dir, chat_jsonl, out, max_steps=1, report_to="swanlab")
    assert main(argv) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists()


def test_a_bad_swanlab_mode_is_an_error_before_anything_loads(monkeypatch):
    monkeypatch.setenv("SWANLAB_MODE", "offlne")
    with pytest.raises(ConfigError, match="SWANLAB_MODE is 'offlne'; set it to one of"):
        check_loggers_installed(["swanlab"])
    check_loggers_installed(["tensorboard"])  # only a swanlab run reads it
