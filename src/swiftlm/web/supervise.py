"""`python -m swiftlm.web.supervise FOLDER -- COMMAND ...`: run COMMAND with its output in
FOLDER/web.log and, when it ends, write its exit status to FOLDER/web_exit.json.

The UI starts every run through this small parent, in a session of its own: the run outlives
the UI, and a UI started later still learns how the run ended (a process cannot wait for one
that is not its child). SIGTERM and SIGINT reach the whole process group, so the command gets
them directly (training then saves a checkpoint and exits 99); this parent only waits for it.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LOG = "web.log"
EXIT = "web_exit.json"


def write_exit(folder: Path, code: int) -> None:
    """Atomically: a reader sees the whole record or none."""
    record = {"exit_code": code, "ended": time.time(), "pid": os.getpid()}
    partial = folder / f".{EXIT}.tmp"
    partial.write_text(json.dumps(record), encoding="utf-8")
    os.replace(partial, folder / EXIT)


def main(argv: list[str]) -> int:
    folder, separator, *command = argv
    if separator != "--" or not command:
        print("usage: python -m swiftlm.web.supervise FOLDER -- COMMAND ...", file=sys.stderr)
        return 2
    folder = Path(folder)
    # A handler rather than SIG_IGN: the command starts with the default dispositions.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    with open(folder / LOG, "ab") as log:
        child = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        code = child.wait()
    # A command killed by a signal: the shell's convention, 128 + the signal number.
    write_exit(folder, 128 - code if code < 0 else code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
