"""Interactive chat in the terminal: `<<< ` asks, `>>> ` answers, history is kept.

Commands: `clear` forgets the history, `exit` or `quit` leaves; so do end of input (Ctrl+D,
or the end of piped stdin) and Ctrl+C. Piped input is read line by line, one question per
line, so `echo "Who are you?" | swiftlm infer ...` prints the answer.
"""

import contextlib
import sys

from swiftlm.config import GenerationArguments
from swiftlm.infer.frontend import InferEngine

PROMPT = "<<< "
ANSWER = ">>> "
EXIT_COMMANDS = ("exit", "quit")
CLEAR_COMMAND = "clear"


def run_chat(
    engine: InferEngine, gen: GenerationArguments, *, system: str | None = None, stream: bool = True
) -> None:
    """Chat until the user exits or input ends."""
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chat started. Type `clear` to forget the history, `exit` to quit.", flush=True)
    history: list[dict] = []
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
            question = {"role": "user", "content": query}
            answer = answer_query(
                engine, gen, system_messages(system) + history + [question], stream
            )
            history += [question, {"role": "assistant", "content": answer}]
    except KeyboardInterrupt:
        print(flush=True)  # leave the shell prompt on a fresh line


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
