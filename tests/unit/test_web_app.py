"""`swiftlm web`'s API: the key, bad input as 400 with swiftlm's message, the data preview, and
the run registry reattaching to runs after the UI restarts."""

import json
import sys
import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from swiftlm.web.app import COOKIE, create_app  # noqa: E402
from swiftlm.web.runs import Registry  # noqa: E402

KEY = "web-key"
GOOD = {
    "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
}
EMPTY_ANSWER = {
    "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": ""}]
}


@pytest.mark.bad_input(
    input="`swiftlm web --api_key K`: a request without the key, or with a wrong one",
    outcome="401 (the login page for a page, JSON for the API), never a 5xx",
)
@pytest.mark.bad_input(
    input="`swiftlm web --api_key K`: a page or API call without the key, or with a wrong one",
    outcome="401 (the login page is the only route open); the key compared in constant time",
)
def test_every_route_but_the_login_page_needs_the_key(tmp_path):
    client = TestClient(create_app(tmp_path, api_key=KEY))
    assert client.get("/api/runs").status_code == 401
    wrong = client.get("/api/runs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json() == {"error": "a valid API key is required"}
    page = client.get("/")
    assert page.status_code == 401 and 'action="/login"' in page.text
    assert client.get("/runs/x/dashboard/").status_code == 401
    assert client.post("/api/runs", json={}).status_code == 401
    assert client.get("/login").status_code == 200
    assert client.post("/login", data={"key": "nope"}).status_code == 401
    ok = client.get("/api/runs", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["runs"] == []
    # The login form sets the cookie, which then opens every route (the dashboard's frame too).
    login = client.post("/login", data={"key": KEY}, follow_redirects=False)
    assert login.status_code == 303 and login.cookies[COOKIE] == KEY
    assert client.get("/").status_code == 200
    assert client.get("/api/form/sft").status_code == 200


@pytest.mark.bad_input(
    input="`swiftlm web`: a bad form (wrong value type, unknown command, bad run name)",
    outcome="HTTP 400 with swiftlm's own message, shown in the page; nothing starts",
)
def test_bad_form_input_is_a_400_with_swiftlms_message(tmp_path):
    client = TestClient(create_app(tmp_path))
    bad_value = {"command": "sft", "name": "r1", "values": {"learning_rate": "abc"}}
    for route in ("/api/command", "/api/runs"):
        reply = client.post(route, json=bad_value)
        assert reply.status_code == 400
        assert "invalid float value: 'abc'" in reply.json()["error"]
    reply = client.post("/api/command", json={"command": "deploy", "name": "r1", "values": {}})
    assert reply.status_code == 400 and "not 'deploy'" in reply.json()["error"]
    reply = client.post("/api/command", json={"command": "sft", "name": "../up", "values": {}})
    assert reply.status_code == 400 and "run name '../up'" in reply.json()["error"]
    reply = client.post(
        "/api/command", json={"command": "sft", "name": "r1", "values": {"dataset": "'a b"}}
    )
    assert reply.status_code == 400 and "No closing quotation" in reply.json()["error"]
    assert client.post("/api/command", json=["not", "a", "form"]).status_code == 422
    # --external_plugins are loaded before the flags are checked, as the CLI does.
    plugin = {"command": "sft", "name": "r1", "values": {"external_plugins": "/nope/p.py"}}
    reply = client.post("/api/command", json=plugin)
    assert reply.status_code == 400 and "/nope/p.py" in reply.json()["error"]
    assert not any(tmp_path.iterdir())  # nothing was started


def test_the_command_line_of_the_default_job(tmp_path):
    client = TestClient(create_app(tmp_path))
    plan = client.post("/api/command", json={"command": "sft", "name": "r1", "values": {}}).json()
    assert plan["command_line"] == f"swiftlm sft --output_dir {tmp_path.resolve() / 'r1'}"
    assert "built-in default job" in plan["note"]


def test_the_preview_shows_the_first_rows_and_each_bad_rows_file_and_line(tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [GOOD] * 7 + [EMPTY_ANSWER, "{not json"]
    data.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    client = TestClient(create_app(tmp_path / "runs"))
    reply = client.post("/api/preview", json={"command": "sft", "values": {"dataset": str(data)}})
    assert reply.status_code == 200, reply.text
    [preview] = reply.json()["datasets"]
    assert preview["checked"] == 9
    assert len(preview["rows"]) == 5
    assert preview["rows"][0]["messages"][1]["content"] == "Hello."
    assert preview["rows"][0]["source"] == f"{data}:1"
    assert len(preview["errors"]) == 2
    assert preview["errors"][0].startswith(f"{data}:8: ")
    assert "assistant" in preview["errors"][0]
    assert preview["errors"][1].startswith(f"{data}:9: ")


# Stand-ins for `swiftlm`: the registry runs `program + argv`, which these replace so that the
# test needs no model. The first waits to be stopped and exits 99 on SIGTERM, as training does.
STOPPABLE = (
    "import signal, sys, time; signal.signal(15, lambda *a: sys.exit(99)); "
    "print('ready', flush=True); time.sleep(60)"
)
QUICK = "print('done')"


def wait_for_state(registry: Registry, folder, state: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while (info := registry.state(folder))["state"] != state:
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    return info


def test_a_new_ui_reattaches_to_running_and_finished_runs(tmp_path):
    first = Registry(tmp_path)
    first.program = [sys.executable, "-c", STOPPABLE]
    running = first.start(first.run_record("long"), ["sft", "--max_steps", "9"])
    assert running["state"] == "running"
    first.program = [sys.executable, "-c", QUICK]
    done = first.run_record("short")
    first.start(done, ["sft"])
    wait_for_state(first, done, "finished")

    second = Registry(tmp_path)  # the UI restarted: no child processes, only the files
    listed = {run["name"]: run for run in second.runs()}
    assert listed["long"]["state"] == "running"
    assert listed["long"]["command_line"] == "swiftlm sft --max_steps 9"
    assert listed["short"]["state"] == "finished"
    assert "done" in (done / "web.log").read_text()
    deadline = time.monotonic() + 20  # its handler is installed (as training's is, after loading)
    while "ready" not in (second.run_record("long") / "web.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second.stop(second.run_record("long"))
    stopped = wait_for_state(second, second.run_record("long"), "stopped")
    assert stopped["exit_code"] == 99
    assert stopped["message"] == "stopped at step ? (checkpoint saved)"  # no checkpoint here

    third = Registry(tmp_path)
    third.program = [sys.executable, "-c", QUICK]
    resumed = third.resume(third.run_record("long"))
    assert resumed["argv"] == ["sft", "--max_steps", "9", "--resume_from_checkpoint", "auto"]
    assert resumed["attempt"] == 2
    assert wait_for_state(third, third.run_record("long"), "finished")["exit_code"] == 0


def test_export_and_eval_run_as_jobs_with_their_logs_and_results(tmp_path):
    app = create_app(tmp_path / "runs")
    registry = app.state.registry
    registry.program = [sys.executable, "-c", QUICK]
    client = TestClient(app)
    model = tmp_path / "runs" / "r1" / "final"
    model.mkdir(parents=True)
    body = {"model": str(model), "values": {"merge_lora": "true"}}
    job = client.post("/api/jobs/export", json=body)
    assert job.status_code == 200, job.text
    folder = registry.runs_dir / ".web" / "export" / job.json()["name"]
    expected = ["export", "--ckpt_dir", str(model), "--merge_lora", "true"]
    assert job.json()["argv"] == [*expected, "--output_dir", str(folder / "model")]
    wait_for_state(registry, folder, "finished")
    (folder / "model").mkdir()
    (folder / "model" / "model.safetensors").write_bytes(b"x" * 10)
    [listed] = client.get("/api/jobs/export").json()["jobs"]
    assert listed["state"] == "finished" and "done" in listed["log"]
    assert listed["results"] == {"files": ["model.safetensors (10 bytes)"]}
    # eval writes where the UI can show its summary; a bad flag value is refused first.
    bad = client.post("/api/jobs/eval", json={"model": str(model), "values": {"eval_limit": "x"}})
    assert bad.status_code == 400 and "invalid" in bad.json()["error"]
    missing = client.post("/api/jobs/eval", json={"model": str(tmp_path / "nope"), "values": {}})
    assert missing.status_code == 400 and "no such folder" in missing.json()["error"]
