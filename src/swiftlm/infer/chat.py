"""Interactive chat in the terminal: `<<< ` asks, `>>> ` answers, history is kept.

Commands: `clear` forgets the history, `exit` or `quit` leaves; so do end of input (Ctrl+D,
or the end of piped stdin) and Ctrl+C. Piped input is read line by line, one question per
line, so `echo "Who are you?" | swiftlm infer ...` prints the answer.

With a vision-language model, `--images a.png b.png` are the images of the first question and
`/image PATH [PATH ...]` attaches images to the next one: they fill the question's `<image>`
tags in order, or go in front of its text when it has none (infer.chat_images). A question
whose tags and images do not pair up is refused with a line saying why, and not asked.
"""

import contextlib
import sys

from swiftlm.data.rows import RowError
from swiftlm.engine.config import GenerationArguments
from swiftlm.errors import ConfigError
from swiftlm.infer.chat_images import IMAGE_COMMAND, question_content, resolve_references
from swiftlm.infer.frontend import InferEngine

PROMPT = "<<< "
ANSWER = ">>> "
EXIT_COMMANDS = ("exit", "quit")
CLEAR_COMMAND = "clear"


def run_chat(
    engine: InferEngine,
    gen: GenerationArguments,
    *,
    system: str | None = None,
    stream: bool = True,
    images: list[str] | None = None,
) -> None:
    """Chat until the user exits or input ends. `images` (checked references, --images) go
    with the first question."""
    interactive = sys.stdin.isatty()
    takes_images = getattr(engine, "takes_images", False)
    if interactive:
        extra = f", `{IMAGE_COMMAND} PATH` to attach an image" if takes_images else ""
        print(
            f"Chat started. Type `clear` to forget the history{extra}, `exit` to quit.",
            flush=True,
        )
    history: list[dict] = []
    pending = list(images or [])  # images of the next question
    try:
        while (query := read_query(interactive)) is not None:
            command = query.strip().lower()
            if not command:
                continue
            if command in EXIT_COMMANDS:
                break
            if command == CLEAR_COMMAND:
                history.clear()
                print("History cleared.", flush=True)
                continue
            if command.split()[0] == IMAGE_COMMAND:
                pending += attach_command(query, takes_images)
                continue
            try:
                content = question_content(query, pending) if takes_images else query
            except RowError as exc:
                print(f"Not asked: {exc}", flush=True)
                continue
            pending = []
            question = {"role": "user", "content": content}
            answer = answer_query(
                engine, gen, system_messages(system) + history + [question], stream
            )
            history += [question, {"role": "assistant", "content": answer}]
    except KeyboardInterrupt:
        print(flush=True)  # leave the shell prompt on a fresh line


def attach_command(line: str, takes_images: bool) -> list[str]:
    """The checked images of an `/image PATH ...` line (none, with a line saying why)."""
    references = line.split()[1:]
    if not takes_images:
        print(f"{IMAGE_COMMAND}: this model is text-only; images need a vision-language model")
        return []
    if not references:
        print(f"{IMAGE_COMMAND}: give the image paths or URLs, e.g. {IMAGE_COMMAND} cat.png")
        return []
    try:
        checked = resolve_references(references, IMAGE_COMMAND)
    except ConfigError as exc:
        print(f"Not attached: {exc}", flush=True)
        return []
    print(f"Attached {len(checked)} image(s) to the next question.", flush=True)
    return checked


def read_query(interactive: bool) -> str | None:
    """The next line the user typed, or None at end of input."""
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (arrow keys and line editing for input())
        try:
            return input(PROMPT)
        except EOFError:
            print(flush=True)
            return None
    line = sys.stdin.readline()
    if not line:
        return None
    query = line.rstrip("\r\n")
    # Echo piped questions so the transcript reads like an interactive session.
    print(PROMPT + query, flush=True)
    return query


def answer_query(
    engine: InferEngine, gen: GenerationArguments, conversation: list[dict], stream: bool
) -> str:
    """Print the answer after `>>> ` (piece by piece when streaming) and return it."""
    print(ANSWER, end="", flush=True)
    if not stream:
        answer = engine.generate([conversation], gen)[0]
        print(answer, flush=True)
        return answer
    pieces = []
    for piece in engine.stream(conversation, gen):
        print(piece, end="", flush=True)
        pieces.append(piece)
    print(flush=True)
    return "".join(pieces)


def system_messages(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []
