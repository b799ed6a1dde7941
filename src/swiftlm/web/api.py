"""The JSON API of the UI and the dashboards of its runs (see `app.py` for the route list)."""

import json
from pathlib import Path

from swiftlm.errors import ConfigError
from swiftlm.web.forms import (
    TRAINING_COMMANDS,
    build_argv,
    command_line,
    form_schema,
    parse_checked,
    recipe_path,
    run_argv,
    uses_default_recipe,
)
from swiftlm.web.preview import preview
from swiftlm.web.runs import Registry, check_name, log_tail
from swiftlm.web.tools import ChatServer, start_tool, tool_result

# Until a run has made its directory, its dashboard waits for it.
WAITING_PAGE = (
    '<!doctype html><meta http-equiv="refresh" content="1"><title>waiting</title>'
    '<p style="font-family: system-ui">Waiting for the run to create its directory...</p>'
)


def training_command(body: dict) -> str:
    command = body.get("command", "sft")
    if command not in TRAINING_COMMANDS:
        raise ConfigError(f"a run is one of {', '.join(TRAINING_COMMANDS)}, not '{command}'")
    return command


def planned(registry: Registry, body: dict) -> tuple[str, list[str], Path]:
    """The command, its checked argv and the run directory of a form's values."""
    command = training_command(body)
    run_dir = registry.run_dir(str(body.get("name", "")))
    return command, run_argv(command, body.get("values", {}), run_dir), run_dir


def build_api(registry: Registry):
    from fastapi import APIRouter

    router = APIRouter()
    chat = ChatServer(registry)
    add_run_routes(router, registry)
    add_dashboard_routes(router, registry)
    add_tool_routes(router, registry, chat)
    return router


def add_run_routes(router, registry: Registry) -> None:
    @router.get("/api/form/{command}")
    def form(command: str):
        return form_schema(command)

    @router.post("/api/command")
    def command(body: dict):
        name, argv, run_dir = planned(registry, body)
        note = ""
        if uses_default_recipe(name, argv[1:]):
            note = f"No --model or --dataset: runs the built-in default job ({recipe_path()})"
        return {"argv": argv, "command_line": command_line(argv), "note": note}

    @router.post("/api/preview")
    def data_preview(body: dict):
        name = training_command(body)
        argv = build_argv(name, body.get("values", {}))
        return {"datasets": preview(name, parse_checked(name, argv))}

    @router.get("/api/runs")
    def runs():
        return {"runs_dir": str(registry.runs_dir), "runs": registry.runs()}

    @router.post("/api/runs")
    def start(body: dict):
        _, argv, run_dir = planned(registry, body)
        record = registry.run_record(run_dir.name)
        if (run_dir.exists() and any(run_dir.iterdir())) or record.exists():
            raise ConfigError(
                f"run {run_dir.name} already exists in {registry.runs_dir}; choose another name "
                "(or resume it from the Runs tab)"
            )
        return registry.start(record, argv, run_dir=run_dir)

    @router.get("/api/runs/{name}")
    def run(name: str):
        record = registry.run_record(name)
        if not record.is_dir() and not registry.run_dir(name).is_dir():
            raise ConfigError(f"no run {name} in {registry.runs_dir}")
        return {**registry.run_state(name), "log": log_tail(record)}

    @router.post("/api/runs/{name}/stop")
    def stop(name: str):
        return registry.stop(registry.run_record(name))

    @router.post("/api/runs/{name}/resume")
    def resume(name: str):
        return registry.resume(registry.run_record(name))


def add_dashboard_routes(router, registry: Registry) -> None:
    """The live dashboard of `swiftlm report --serve`, one per run, under /runs/<name>/dashboard/:
    the same page and `data?since=` polling (report.dashboard), served by this app."""
    from fastapi.responses import HTMLResponse, Response

    from swiftlm.report.dashboard import POLL_MS, RunView
    from swiftlm.report.page import render_page

    views: dict[str, RunView] = {}

    def view(name: str) -> RunView:
        folder = registry.run_dir(check_name(name))
        if name not in views:
            views[name] = RunView(folder)
        return views[name]

    @router.get("/runs/{name}/dashboard/", response_class=HTMLResponse)
    def page(name: str):
        if not registry.run_dir(name).is_dir():  # the run has not made its folder yet
            return WAITING_PAGE
        update = view(name).current()
        live = {"version": update["version"], "interval_ms": POLL_MS}
        return render_page(update["_cards"], update["names"], update["latest_step"], live)

    @router.get("/runs/{name}/dashboard/data")
    def data(name: str, since: str = ""):
        from plotly.utils import PlotlyJSONEncoder

        update = view(name).current()
        if since == update["version"]:
            body = {"version": update["version"]}
        else:
            body = {k: v for k, v in update.items() if not k.startswith("_")}
        return Response(json.dumps(body, cls=PlotlyJSONEncoder), media_type="application/json")


def add_tool_routes(router, registry: Registry, chat: ChatServer) -> None:
    from fastapi.responses import StreamingResponse

    @router.get("/api/models")
    def models():
        """Every run's checkpoints and final model: what chat, export and eval can load."""
        found = []
        for run in registry.runs():
            found += [{"run": run["name"], **c} for c in run["checkpoints"]]
        return {"models": found}

    @router.get("/api/chat")
    def chat_status():
        return chat.status()

    @router.post("/api/chat")
    def chat_load(body: dict):
        return chat.load(str(body.get("model", "")))

    @router.post("/api/chat/unload")
    def chat_unload():
        return chat.unload()

    @router.post("/api/chat/completions")
    def chat_completions(body: dict):
        return StreamingResponse(chat.stream(body), media_type="text/event-stream")

    @router.get("/api/jobs/{kind}")
    def jobs(kind: str):
        found = registry.jobs(check_name(kind))
        for job in found:
            folder = Path(job["folder"])
            job.update(log=log_tail(folder, 40), results=tool_result(folder))
        return {"jobs": found}

    @router.post("/api/jobs/{kind}")
    def start_job(kind: str, body: dict):
        return start_tool(registry, kind, str(body.get("model", "")), body.get("values", {}))
