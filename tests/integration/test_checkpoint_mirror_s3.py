"""The mirror tier on an S3-compatible endpoint on 127.0.0.1 (moto's server mode): a run's
checkpoints are copied there in the background, every local copy is deleted, and
`--resume_from_checkpoint auto` downloads the newest one and finishes with the weights of
the uninterrupted run."""

import json
import shutil
import socket

import pytest

from conftest import tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_same_weights

moto_server = pytest.importorskip(
    "moto.server", reason="moto[server] is not installed (the dev extra: scripts/setup.sh)"
)
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (the cloud extra)")

ADAPTER = "final/adapter_model.safetensors"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def s3_endpoint():
    """(endpoint URL, fsspec options) of a moto S3 server with an empty bucket `ckpts`."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    options["client_kwargs"] = {"region_name": "us-east-1"}
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )  # fmt: skip
    client.create_bucket(Bucket="ckpts")
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    yield options, fs
    server.stop()


def test_a_mirrored_checkpoint_is_resumed_after_the_local_copies_are_gone(
    s3_endpoint, tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    options, fs = s3_endpoint
    run = tmp_path / "run"
    flags = dict(
        max_steps=6,
        save_steps=2,
        per_device_train_batch_size=4,
        checkpoint_mirror="s3://ckpts/run",
        checkpoint_mirror_options=json.dumps(options),
    )
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 0
    fs.invalidate_cache()
    assert sorted(fs.ls("ckpts/run/checkpoints", detail=False)) == [
        f"ckpts/run/checkpoints/step-{n}" for n in (2, 4, 6)
    ]
    assert fs.exists("ckpts/run/checkpoints/step-6/COMPLETE")
    uninterrupted = tmp_path / "uninterrupted.safetensors"
    shutil.copy(run / ADAPTER, uninterrupted)

    # The machine is lost after step 4's copy: nothing local is left, the mirror has step 4.
    fs.rm("ckpts/run/checkpoints/step-6", recursive=True)
    shutil.rmtree(run)
    capsys.readouterr()
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags, resume_from_checkpoint="auto")) == 0
    )
    printed = capsys.readouterr().out
    assert "downloading step-4 from the mirror s3://ckpts/run" in printed
    assert f"resumed from {run}/checkpoints/step-4 (mirror) at step 4" in printed
    assert_same_weights(uninterrupted, run / ADAPTER)

    # A mirrored checkpoint named by its URL, into a new run directory.
    again = tmp_path / "again"
    url = "s3://ckpts/run/checkpoints/step-2"
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, again, **flags, resume_from_checkpoint=url)) == 0
    )
    assert f"resumed from {again}/checkpoints/step-2 (mirror) at step 2" in capsys.readouterr().out
    assert_same_weights(uninterrupted, again / ADAPTER)
