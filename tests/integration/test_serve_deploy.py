"""The `swiftlm deploy` command: flags, the missing extra, adapter names, and a real process
that drains on SIGTERM and exits 0."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import ServerThread, SlowEngine, free_port  # noqa: E402

from swiftlm.cli.main import main  # noqa: E402
from swiftlm.errors import ConfigError  # noqa: E402
from swiftlm.serve.models import parse_adapters  # noqa: E402


@pytest.mark.bad_input(
    input="`swiftlm deploy` without the serve extra (fastapi, uvicorn, prometheus-client)",
    outcome="Error before the model loads: names the missing packages and "
    "`pip install 'swiftlm[serve]'`",
)
def test_deploy_without_the_extra_names_the_install_command(tiny_model_dir):
    # A fresh interpreter in which `import fastapi` and `import uvicorn` fail.
    code = (
        "import sys; sys.modules['fastapi'] = sys.modules['uvicorn'] = None; "
        "from swiftlm.cli.main import main; "
        f"sys.exit(main(['deploy', '--model', {str(tiny_model_dir)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "fastapi, uvicorn" in done.stderr and "pip install 'swiftlm[serve]'" in done.stderr


def test_adapters_are_named_by_flag_or_folder(tmp_path):
    run = tmp_path / "my-run" / "final"
    assert parse_adapters(["a=/x/y", str(run), "/z/other"]) == {
        "a": "/x/y",
        "my-run": str(run),
        "other": "/z/other",
    }


@pytest.mark.bad_input(
    input="`swiftlm deploy --adapters a=x a=y` (a name twice), or `--ckpt_dir` with `--adapters`",
    outcome="Error naming the flag before anything loads",
)
def test_conflicting_adapter_flags_are_refused(capsys, tmp_path):
    with pytest.raises(ConfigError, match="given twice"):
        parse_adapters(["a=/x", "a=/y"])
    assert main(["deploy", "--ckpt_dir", str(tmp_path), "--adapters", "a=/x"]) == 2
    assert "--ckpt_dir and --adapters both given" in capsys.readouterr().err


def test_deploy_flags_are_checked(capsys):
    assert main(["deploy", "--port", "0", "--max_num_seqs", "0"]) == 2
    error = capsys.readouterr().err
    assert "--port 0 must be in [1, 65535]" in error and "--max_num_seqs 0" in error


def test_a_draining_server_answers_503(tiny_tokenizer):
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    engine = SlowEngine(token_id=5)
    app = generation_app(engine, tiny_tokenizer, ServedModels("tiny"), ServerSettings())
    with ServerThread(app) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 200
        app.state.server.draining = True
        reply = httpx.get(f"{url}/v1/models")
        assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"]
    engine.shutdown()


def test_sigterm_lets_the_running_stream_finish_then_exits_0(tiny_model_dir):
    port = free_port()
    command = [sys.executable, "-m", "swiftlm", "deploy", "--model", str(tiny_model_dir)]
    command += ["--port", str(port), "--max_model_len", "512", "--served_model_name", "tiny"]
    # Generous: on a shared 2-core machine a few hundred steps can take many seconds.
    command += ["--shutdown_timeout", "120"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread, as the in-process tests run
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        banner = wait_for_banner(server)
        assert f"Serving tiny at http://127.0.0.1:{port}/v1" in banner
        url = f"http://127.0.0.1:{port}"
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        lines = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=150) as reply:
            stream = reply.iter_lines()
            lines.append(next(stream))
            server.send_signal(signal.SIGTERM)
            lines += list(stream)
        lines = [line for line in lines if line]  # events are separated by blank lines
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-1] == "data: [DONE]"
        assert sum(len(e["choices"][0]["delta"].get("content", "")) > 0 for e in events) > 50
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert server.wait(timeout=120) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        if server.poll() is None:
            server.kill()


def wait_for_banner(server: subprocess.Popen) -> str:
    """The output up to the line that says the server is up (printed before uvicorn starts,
    so wait for /health too)."""
    seen = []
    deadline = time.monotonic() + 120
    for line in server.stdout:
        seen.append(line)
        if line.startswith("Serving "):
            break
        assert time.monotonic() < deadline, "".join(seen)
    else:
        raise AssertionError("deploy exited early:\n" + "".join(seen))
    threading.Thread(target=server.stdout.read, daemon=True).start()  # keep the pipe drained
    port = seen[-1].rsplit(":", 1)[1].split("/")[0]
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return "".join(seen)
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline, "".join(seen)
        time.sleep(0.1)


def test_plan_names_the_base_and_the_adapters(tiny_model_dir, tiny_lora_run):
    from swiftlm.config import DeployConfig, parse_config
    from swiftlm.serve.models import plan_deployment

    def plan(*argv):
        return plan_deployment(parse_config(DeployConfig, list(argv), "swiftlm deploy"))

    # No --model: the base comes from the run's config.yaml; the adapter stays unmerged.
    named = plan("--adapters", f"tuned={tiny_lora_run}")
    assert named.served.names() == [tiny_model_dir.name, "tuned"]
    assert named.named_adapters == {"tuned": str((tiny_lora_run / "final").resolve())}
    assert named.spec.adapters == () and named.spec.base_path == str(tiny_model_dir.resolve())
    # --ckpt_dir: the run alone, merged into its base, named after the run.
    run = plan("--ckpt_dir", str(tiny_lora_run), "--served_model_name", "custom")
    assert run.served.names() == ["custom"] and run.named_adapters == {}
    assert run.spec.adapters == (str((tiny_lora_run / "final").resolve()),)
    assert plan("--ckpt_dir", str(tiny_lora_run)).served.names() == ["my-run"]
    with pytest.raises(ConfigError, match="base model's name"):
        plan("--adapters", f"{tiny_model_dir.name}={tiny_lora_run}")


def test_an_adapter_of_the_default_model_is_served_beside_it_by_its_name(
    tiny_model_dir, tiny_lora_run, tmp_path, monkeypatch
):
    """A run trained on the packaged default (config.yaml `model: null`) serves its base under
    the default's name, not the name of the GGUF conversion's cache folder."""
    import shutil

    import yaml

    from swiftlm.checkpoint import resolve
    from swiftlm.config import DeployConfig, parse_config
    from swiftlm.models.loader import ResolvedModel
    from swiftlm.serve.models import plan_deployment

    run = tmp_path / "default-run"
    shutil.copytree(tiny_lora_run, run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["model"]["model"] = None
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    packaged = ResolvedModel(str(tiny_model_dir), "packaged GGUF", "SmolLM2-135M-Instruct")
    monkeypatch.setattr(resolve, "resolve_model", lambda model: packaged)
    cfg = parse_config(DeployConfig, ["--adapters", f"swifty={run}"], "swiftlm deploy")
    assert plan_deployment(cfg).served.names() == ["SmolLM2-135M-Instruct", "swifty"]


@pytest.mark.bad_input(
    input="`swiftlm deploy --port P` where P is already in use",
    outcome="Error before the model loads, naming --host/--port and the reason",
)
def test_a_taken_port_fails_before_the_model_loads(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["deploy", "--model", "/no/such/model", "--port", str(port)]) == 2
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in capsys.readouterr().err
