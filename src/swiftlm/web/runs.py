"""The runs of the UI: ordinary `swiftlm` processes with ordinary run directories.

A run `NAME` is the run directory RUNS_DIR/NAME, untouched by the UI (swiftlm refuses a new run
in a folder that holds other files), and the UI's record of it in RUNS_DIR/.web/runs/NAME:
`web_run.json` (argv, pid, start time, attempt), `web.log` (the command's output) and
`web_exit.json` (its exit status, written by `supervise`, the session leader it runs under).
Export, evaluation and chat jobs keep the same three files in RUNS_DIR/.web/<kind>/<id>. Every
answer about a run is read back from its folder and the process table, so closing the browser
or restarting `swiftlm web` loses nothing: the UI reattaches to running and finished runs.

State of a run: running (its supervisor is alive), finished (exit 0), stopped (exit 99, the
preemption status: a checkpoint was saved), failed (any other status), interrupted (the
process is gone without a word: killed, or the machine restarted). A run directory that the
UI did not start (a run from a terminal) is listed from its files alone.
"""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from swiftlm.checkpoint.folders import is_complete, list_checkpoints, step_of
from swiftlm.errors import ConfigError
from swiftlm.web.supervise import EXIT, LOG

RECORD = "web_run.json"
PREEMPTED = 99  # swiftlm.errors.Preempted.exit_code: stopped after saving a checkpoint
KILLED_BY_SIGTERM = 128 + signal.SIGTERM  # as supervise records a death by signal
RESUME = ["--resume_from_checkpoint", "auto"]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
TAIL_BYTES = 64 * 1024


def check_name(name: str) -> str:
    """A run name is one folder under the runs folder, never a path."""
    if not NAME.fullmatch(name):
        raise ConfigError(
            f"run name {name!r}: use letters, digits, '.', '_' and '-' (at most 100), "
            "starting with a letter or digit"
        )
    return name


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def supervisor_alive(pid: int, folder: Path) -> bool:
    """True while the run's supervisor runs. The command line is compared too, so a pid that
    the system gave to another process since is not taken for the run."""
    if Path("/proc/self").exists():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"swiftlm.web.supervise" in args and str(folder).encode() in args
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of a text file (empty if it does not exist)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    # Progress bars redraw with carriage returns: keep the last drawing of each line.
    return [line.rsplit("\r", 1)[-1] for line in text.splitlines()[-count:]]


def latest_metrics(run_dir: Path) -> dict:
    """{"step", "loss"} of the last logged training step (empty before the first)."""
    for line in reversed(tail_lines(run_dir / "metrics.jsonl", 200)):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row and "step" in row:
            return {"step": row["step"], "loss": row["loss"]}
    return {}


def checkpoints(run_dir: Path) -> list[dict]:
    """The complete checkpoints and the final model: what can be chatted with or resumed."""
    complete, _ = list_checkpoints(run_dir) if (run_dir / "checkpoints").is_dir() else ([], [])
    found = [{"path": str(c), "label": f"step {step_of(c)}"} for c in complete if is_complete(c)]
    if (run_dir / "final").is_dir():
        found.append({"path": str(run_dir / "final"), "label": "final"})
    return found[::-1]  # the newest first


class Registry:
    """The runs (`runs_dir/<name>`) and tool jobs (`runs_dir/.web/<kind>/<id>`) of the UI."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = Path(runs_dir).resolve()
        self.children: dict[Path, subprocess.Popen] = {}  # reaped by `state`
        self.program = [sys.executable, "-m", "swiftlm"]  # `swiftlm`, as this interpreter runs it

    def run_dir(self, name: str) -> Path:
        return self.runs_dir / check_name(name)

    def run_record(self, name: str) -> Path:
        """Where the UI keeps its record of run `name` (its run directory stays ordinary)."""
        return self.runs_dir / ".web" / "runs" / check_name(name)

    def start(
        self, folder: Path, argv: list[str], extra: dict | None = None, run_dir: Path | None = None
    ) -> dict:
        """Run `swiftlm <argv>`, its record in `folder`; `run_dir`: the run directory it writes
        (metrics and checkpoints are read from there)."""
        folder.mkdir(parents=True, exist_ok=True)
        previous = read_json(folder / RECORD) or {}
        if previous and self.state(folder)["state"] == "running":
            raise ConfigError(f"{folder.name} is running; stop it first")
        (folder / EXIT).unlink(missing_ok=True)
        command = [*self.program, *argv]
        supervisor = [sys.executable, "-m", "swiftlm.web.supervise", str(folder), "--", *command]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(folder / LOG, "ab") as log:
            log.write(f"\n$ {shlex.join(['swiftlm', *argv])}\n".encode())
            log.flush()
            process = subprocess.Popen(
                supervisor,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives the UI; one group to signal
                env=env,  # and the UI's working directory: relative paths mean the same
            )
        self.children[folder] = process
        record = {
            "argv": argv,
            "pid": process.pid,
            "started": time.time(),
            "attempt": previous.get("attempt", 0) + 1,
            "run_dir": str(run_dir or previous.get("run_dir") or folder),
            **(extra or {}),
        }
        (folder / RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")
        return self.state(folder)

    def stop(self, folder: Path) -> dict:
        """SIGTERM to the run's process group: training saves a checkpoint and exits 99."""
        record = read_json(folder / RECORD)
        if record is None or self.state(folder)["state"] != "running":
            raise ConfigError(f"{folder.name} is not running")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record["pid"], signal.SIGTERM)
        return self.state(folder)

    def resume(self, folder: Path) -> dict:
        """The same command again, with --resume_from_checkpoint auto."""
        record = read_json(folder / RECORD)
        if record is None:
            raise ConfigError(f"{folder.name} was not started from the UI: nothing to resume")
        argv = list(record["argv"])
        if "--resume_from_checkpoint" not in argv:
            argv += RESUME
        own = ("argv", "pid", "started", "attempt", "run_dir")
        kept = {k: v for k, v in record.items() if k not in own}
        return self.start(folder, argv, kept)

    def _alive(self, folder: Path, pid: int) -> bool:
        child = self.children.get(folder)
        if child is not None and child.pid == pid:
            return child.poll() is None  # also reaps it
        return supervisor_alive(pid, folder)

    def state(self, folder: Path) -> dict:
        """What the UI shows about one run or job, from its folder and the process table."""
        record = read_json(folder / RECORD)
        if record is None:  # a run directory the UI did not start
            return self.files_state(folder)
        ended = read_json(folder / EXIT)
        run_dir = Path(record.get("run_dir", folder))
        info = self.files_state(run_dir, name=folder.name)
        info.update(
            argv=record["argv"],
            command_line=shlex.join(["swiftlm", *record["argv"]]),
            started=record["started"],
            attempt=record.get("attempt", 1),
            extra={k: v for k, v in record.items() if k not in ("argv", "pid", "started")},
            record=str(folder),
        )
        if self._alive(folder, record["pid"]):
            info["state"] = "running"
        elif ended is not None and ended.get("pid") == record["pid"]:
            info.update(self._ended(folder, run_dir, ended["exit_code"]))
            info["exit_code"] = ended["exit_code"]
        else:
            info["state"] = "finished" if (run_dir / "final").is_dir() else "interrupted"
        return info

    @staticmethod
    def files_state(run_dir: Path, name: str | None = None) -> dict:
        """What the run directory's files say (for a run the UI did not start: all there is)."""
        return {
            "name": name or run_dir.name,
            "folder": str(run_dir),
            "state": "finished" if (run_dir / "final").is_dir() else "external",
            "checkpoints": checkpoints(run_dir),
            **latest_metrics(run_dir),
        }

    def _ended(self, folder: Path, run_dir: Path, code: int) -> dict:
        if code == 0:
            return {"state": "finished"}
        if code == PREEMPTED:
            saved = [c for c in checkpoints(run_dir) if c["label"].startswith("step")]
            step = saved[0]["label"].split()[-1] if saved else "?"
            return {"state": "stopped", "message": f"stopped at step {step} (checkpoint saved)"}
        if code == KILLED_BY_SIGTERM:  # stopped before training had its handler (loading)
            return {"state": "stopped", "message": "stopped before training began (no checkpoint)"}
        last = [line for line in tail_lines(folder / LOG, 40) if line.strip()]
        return {"state": "failed", "message": "\n".join(last[-8:]) or f"exit status {code}"}

    def run_state(self, name: str) -> dict:
        record = self.run_record(name)
        if (record / RECORD).is_file():
            return self.state(record)
        return self.files_state(self.run_dir(name))

    def runs(self) -> list[dict]:
        """Every run: those the UI started and the run directories under the runs folder,
        newest first."""
        names = {p.name: p for p in _folders(self.runs_dir / ".web" / "runs")}
        for p in _folders(self.runs_dir):
            if _is_run_dir(p):
                names.setdefault(p.name, p)
        newest = sorted(names, key=lambda n: names[n].stat().st_mtime, reverse=True)
        return [self.run_state(name) for name in newest]

    def job_folder(self, kind: str) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        folder = self.runs_dir / ".web" / kind / stamp
        suffix = 1
        while folder.exists():
            suffix += 1
            folder = self.runs_dir / ".web" / kind / f"{stamp}-{suffix}"
        return folder

    def jobs(self, kind: str) -> list[dict]:
        root = self.runs_dir / ".web" / kind
        folders = sorted(root.iterdir(), reverse=True) if root.is_dir() else []
        return [self.state(p) for p in folders if (p / RECORD).is_file()]


def _folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]


def _is_run_dir(folder: Path) -> bool:
    return any((folder / name).exists() for name in ("config.yaml", "metrics.jsonl", "final"))


def log_tail(folder: Path, count: int = 200) -> str:
    return "\n".join(tail_lines(folder / LOG, count))
