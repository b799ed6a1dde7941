"""Write swiftlm's built-in verifiable task for GRPO: single- and low-two-digit additions.

    .venv/bin/python scripts/make_arithmetic_data.py

Every sum a + b with a, b in 1..12 is a prompt ("What is 7 + 5?") with its `solution`; 40 of
the 144, chosen with a fixed seed, are held out (swiftlm/arithmetic-heldout) and the others
are the training prompts (swiftlm/arithmetic). The default model (SmolLM2-135M-Instruct)
answers about a third of them right when greedy, mostly by talking past the answer or
stopping early: room for GRPO's `accuracy` reward to show (docs/alignment.md, "GRPO").
"""

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "swiftlm" / "assets"
HELD_OUT = 40


def rows() -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "solution": str(a + b)}
        for a in range(1, 13)
        for b in range(1, 13)
    ]


def main() -> None:
    everything = rows()
    random.Random(0).shuffle(everything)
    splits = {
        "arithmetic_heldout.jsonl": everything[:HELD_OUT],
        "arithmetic.jsonl": everything[HELD_OUT:],
    }
    for name, split in splits.items():
        with (ASSETS / name).open("w", encoding="utf-8") as out:
            for row in split:
                out.write(json.dumps(row) + "\n")
        print(f"{ASSETS / name}: {len(split)} prompts")


if __name__ == "__main__":
    main()
