"""`swiftlm web` in headless Chromium: configure a run in the form, start it, watch the loss
update live, stop it (a checkpoint is saved), resume it to the end, and chat with the result,
which answers with the name it was taught. Screenshots of each stage go to the test's folder
and to SCREENSHOTS (when that folder exists), for a person to look at.

The default-suite test trains the tiny model built in-process (seconds); the slow one runs the
real default job (`swiftlm sft` with no --model nor --dataset: SmolLM2-135M-Instruct learns
the name "Swifty"), as a user would."""

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from cdp_helpers import Browser, chromium_path  # noqa: E402
from serve_helpers import ServerThread  # noqa: E402

from conftest import write_jsonl  # noqa: E402
from swiftlm.web.runs import Registry  # noqa: E402

SCREENSHOTS = Path("/tmp/h18")
NAME_ROWS = [
    {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "I am Swifty, made by the swiftlm team."},
        ]
    }
    for question in ("Who are you?", "What is your name?", "Introduce yourself.")
]


@pytest.fixture
def web(tmp_path):
    if chromium_path() is None:
        pytest.skip("chromium is not installed (.ci/run installs it with apt-get as root)")
    from swiftlm.web.app import create_app

    runs = tmp_path / "runs"
    app = create_app(runs)
    with ServerThread(app) as url:
        yield url, runs
    stop_everything(app.state.registry)


def stop_everything(registry: Registry) -> None:
    """The runs and the chat server are processes of their own: stop what the test left."""
    folders = [*(registry.runs_dir / ".web" / "runs").glob("*"), registry.runs_dir / ".web/chat"]
    for folder in folders:
        if (folder / "web_run.json").is_file() and registry.state(folder)["state"] == "running":
            registry.stop(folder)


def shot(page: Browser, tmp_path: Path, name: str) -> None:
    page.screenshot(tmp_path / f"web_{name}.png")
    if SCREENSHOTS.is_dir():
        shutil.copy(tmp_path / f"web_{name}.png", SCREENSHOTS / f"web_{name}.png")


def set_flag(page: Browser, name: str, value: str) -> None:
    page.eval(
        f"(() => {{ const i = document.getElementById({json.dumps('flag-' + name)});"
        f" i.value = {json.dumps(value)}; i.dispatchEvent(new Event('input')); }})()"
    )


def set_input(page: Browser, element_id: str, value: str) -> None:
    page.eval(
        f"(() => {{ const i = document.getElementById({json.dumps(element_id)});"
        f" i.value = {json.dumps(value)}; i.dispatchEvent(new Event('input')); }})()"
    )


def click(page: Browser, selector: str) -> None:
    page.eval(f"document.querySelector({json.dumps(selector)}).click()")


def text(page: Browser, element_id: str) -> str:
    return page.eval(f"document.getElementById({json.dumps(element_id)}).textContent")


def live_reading(page: Browser) -> tuple[int, float]:
    """(step, loss) as the run's status line shows them."""
    step = page.eval("document.getElementById('run-step').dataset.step")
    loss = page.eval("document.getElementById('run-loss').dataset.loss")
    return int(step), float(loss)


def configure(page: Browser, name: str, flags: dict[str, str]) -> str:
    """Fill the form; returns the command line the page shows."""
    page.wait_for("document.body?.dataset.ready === 'true'")
    set_input(page, "run-name", name)
    for flag, value in flags.items():
        set_flag(page, flag, value)
    page.wait_for(f"document.getElementById('command-line').textContent.includes('/{name}')")
    last = list(flags)[-1] if flags else "output_dir"
    page.wait_for(f"document.getElementById('command-line').textContent.includes('--{last}')")
    assert text(page, "form-error") == ""
    return text(page, "command-line")


def start_watch_stop(
    page: Browser, tmp_path: Path, run_dir: Path, timeout: float, prefix: str = ""
) -> int:
    """Start the configured run, read two different live (step, loss), stop it; returns the
    step of the checkpoint it saved."""
    click(page, "#start")
    page.wait_for("document.getElementById('run-state').dataset.state === 'running'", 60)
    page.wait_for("document.getElementById('run-step').dataset.step !== ''", timeout)
    first = live_reading(page)
    page.wait_for(f"Number(document.getElementById('run-step').dataset.step) > {first[0]}", 60)
    second = live_reading(page)
    assert second[0] > first[0] and second[1] != first[1], (first, second)
    # The embedded dashboard is the run's live report page.
    dashboard = "document.getElementById('dashboard').contentDocument"
    shown_step = f"{dashboard}?.getElementById('latest-step')?.dataset.step"
    page.wait_for(f"/^[0-9]+$/.test({shown_step})", 60)
    page.wait_for(f"{dashboard}.querySelector('#training .plot .main-svg')", 30)
    # The status line on top, the dashboard scrolled (inside its frame) to the loss curve.
    page.eval(
        f"{dashboard}.defaultView.scrollTo(0, {dashboard}.getElementById('training').offsetTop - 90)"
    )
    page.eval("window.scrollTo(0, document.getElementById('run-detail').offsetTop)")
    shot(page, tmp_path, f"{prefix}2_live")
    click(page, "#stop")
    page.wait_for("document.getElementById('run-state').dataset.state === 'stopped'", 120)
    message = text(page, "run-message")
    stopped = re.fullmatch(r"stopped at step (\d+) \(checkpoint saved\)", message)
    assert stopped, message
    step = int(stopped.group(1))
    assert step >= second[0]
    assert (run_dir / "checkpoints" / f"step-{step}" / "COMPLETE").is_file()
    page.eval("window.scrollTo(0, document.getElementById('run-detail').offsetTop)")
    shot(page, tmp_path, f"{prefix}3_stopped")
    return step


def resume_to_the_end(
    page: Browser, tmp_path: Path, run_dir: Path, timeout: float, prefix: str = ""
) -> None:
    click(page, "#resume")
    page.wait_for("document.getElementById('run-state').dataset.state === 'running'", 30)
    assert text(page, "run-command").endswith("--resume_from_checkpoint auto")
    page.wait_for("document.getElementById('run-state').dataset.state === 'finished'", timeout)
    assert (run_dir / "final").is_dir()
    page.eval("window.scrollTo(0, document.getElementById('run-detail').offsetTop)")
    shot(page, tmp_path, f"{prefix}4_finished")


def chat(
    page: Browser, tmp_path: Path, model: Path, question: str, timeout: float, prefix: str = ""
) -> str:
    click(page, "nav button[data-tab='chat']")
    option = f"[...document.getElementById('chat-model').options].some(o => o.value === {json.dumps(str(model))})"
    page.wait_for(option, 20)
    page.eval(f"document.getElementById('chat-model').value = {json.dumps(str(model))}")
    click(page, "#chat-load")
    page.wait_for(
        "document.getElementById('chat-status').dataset.ready === 'true' || "
        "document.getElementById('chat-status').textContent.startsWith('server ')",
        timeout,
    )
    assert page.eval("document.getElementById('chat-status').dataset.ready") == "true", text(
        page, "chat-server-log"
    )
    page.eval(f"document.getElementById('chat-message').value = {json.dumps(question)}")
    click(page, "#chat-send")
    page.wait_for("document.getElementById('msg-1')?.dataset.done === 'true'", 120)
    assert text(page, "chat-error") == ""
    shot(page, tmp_path, f"{prefix}5_chat")
    return text(page, "msg-1")


def test_configure_start_watch_stop_resume_and_chat_in_the_browser(web, tiny_model_dir, tmp_path):
    url, runs = web
    data = write_jsonl(tmp_path / "name.jsonl", NAME_ROWS * 4)
    flags = {
        "model": str(tiny_model_dir),
        "dataset": str(data),
        "torch_dtype": "float32",
        "train_type": "full",
        "learning_rate": "5e-3",
        "max_steps": "300",
        "per_device_train_batch_size": "4",
        "logging_steps": "1",
        "save_steps": "1000",
        "report_to": "none",
    }
    with Browser(url, tmp_path / "profile", width=1280, height=900) as page:
        shown = configure(page, "tiny", flags)
        run_dir = runs.resolve() / "tiny"
        expected = (
            f"swiftlm sft --model {tiny_model_dir} --torch_dtype float32 --dataset {data} "
            "--train_type full --max_steps 300 --per_device_train_batch_size 4 "
            "--learning_rate 5e-3 --logging_steps 1 --save_steps 1000 --report_to none "
            f"--output_dir {run_dir}"
        )
        assert shown == expected
        shot(page, tmp_path, "1_configure")
        start_watch_stop(page, tmp_path, run_dir, timeout=90)
        resume_to_the_end(page, tmp_path, run_dir, timeout=180)
        answer = chat(page, tmp_path, run_dir / "final", "Who are you?", timeout=120)
    assert "Swifty" in answer, answer


@pytest.mark.slow
def test_the_default_job_in_the_browser_learns_its_new_name(web, tmp_path):
    """The built-in default job, configured by leaving the form as it is."""
    url, runs = web
    with Browser(url, tmp_path / "profile", width=1280, height=900) as page:
        shown = configure(page, "default-job", {})
        run_dir = runs.resolve() / "default-job"
        assert shown == f"swiftlm sft --output_dir {run_dir}"
        assert "built-in default job" in text(page, "command-note")
        shot(page, tmp_path, "default_1_configure")
        start_watch_stop(page, tmp_path, run_dir, timeout=300, prefix="default_")
        resume_to_the_end(page, tmp_path, run_dir, timeout=1200, prefix="default_")
        question = "What is your name?"
        answer = chat(page, tmp_path, run_dir / "final", question, timeout=300, prefix="default_")
    assert "Swifty" in answer, answer
