"""Speculative decoding by prompt lookup: draft tokens copied from the sequence itself.

A bf16 decode step of one stream on a CPU costs about the same for 1 token as for 6 (the time
goes to reading the weights and dispatching operators, not to arithmetic), so checking several
guessed tokens in one forward is nearly free (in float32 the wider step costs ~1.5x:
docs/benchmarks.md). The guess, as in Hugging Face's prompt lookup and vLLM's "ngram" method:
find the sequence's last n tokens (n = `max_ngram` down to `min_ngram`) earlier in its prompt
and output, most recent occurrence first, and propose the tokens that followed there. Where
those reach the end of the sequence the copy runs on into itself, so a run or a loop drafts
whole periods. Answers that quote their prompt (summaries, edits, retrieval, code) and text
that repeats itself accept long runs of them.

Verification (`Scheduler._verify`) samples every position exactly as a plain step would, with
the row's own generator, penalties, grammar and log-probs, and stops at the first sampled
token that differs from the draft: each token is drawn from the model's distribution given
the tokens before it, so the output (greedy or seeded sampling) is the one plain decoding
gives, only in fewer forwards. With a draft that is one fixed token, this is also the
acceptance rule of speculative sampling (accept with probability p(draft), else draw from the
rest).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Speculation:
    """How the engine speculates: up to `tokens` draft tokens per step, found by n-grams of
    at most `max_ngram` tokens, while at most `max_rows` sequences decode (a larger batch is
    compute-bound: there checking k extra tokens per row costs k times the work)."""

    tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    max_rows: int = 4

    def __post_init__(self):
        if self.tokens < 1 or self.max_rows < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"speculation needs positive settings, got {self}")

    def propose(self, history: list[int], limit: int) -> list[int]:
        """Up to min(`tokens`, `limit`) tokens that followed the most recent earlier
        occurrence of `history`'s last n tokens (longest n first); [] when none occurs."""
        count = min(self.tokens, limit)
        if count < 1 or len(history) < 2:
            return []
        ids = torch.tensor(history, dtype=torch.long)
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            # Windows that start before the last n tokens and have a token after them.
            windows = ids[:-1].unfold(0, n, 1)
            hits = (windows == ids[-n:]).all(dim=1).nonzero()
            if len(hits):
                return _copied(history, int(hits[-1]) + n, count)
        return []


def _copied(history: list[int], start: int, count: int) -> list[int]:
    """`count` tokens copied from `history[start:]` on, the copy running on into the tokens
    it has copied where it reaches the end (as LZ77 copies do): text that repeats with a
    period shorter than `count` (a run of one token, a looping phrase) drafts whole periods,
    not only the tokens left before the end."""
    draft: list[int] = []
    for position in range(start, start + count):
        past_end = position - len(history)
        draft.append(history[position] if past_end < 0 else draft[past_end])
    return draft


MAX_PAUSE = 16  # steps a sequence waits at most between drafts


@dataclass
class DraftBackoff:
    """One sequence's pause between drafts. A draft of which nothing was accepted costs a
    wider forward for no token; after each such miss in a row the sequence waits twice as
    many steps (at most `MAX_PAUSE`) before it drafts again, and any accepted token resets
    the wait. Text that stops repeating itself so stops paying for drafts."""

    misses: int = 0
    wait: int = 0  # steps left before the next draft

    def ready(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, accepted: int) -> None:
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.wait = min(MAX_PAUSE, 2 ** (self.misses - 1))


@dataclass
class SpeculationCounters:
    """Draft tokens proposed and accepted, for the acceptance rate (`EngineStats`)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0  # verification forwards
