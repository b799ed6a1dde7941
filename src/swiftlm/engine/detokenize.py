"""Incremental text of a growing token sequence, cut at stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and
for sentencepiece (a token's leading space depends on its neighbour), so, as vLLM does, each
step decodes a short window of recent tokens and emits only what the window added; text that
ends in an incomplete character (U+FFFD) waits for the next token.

Stop strings: the text stops before the first occurrence of any of them. Text that might be
the start of a stop string is held back until the next tokens resolve it, so a client never
receives part of a stop string.
"""

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Text of the tokens appended so far; `add` returns what a new token added."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window's first token: context for the next decode
        self.read_offset = 0  # tokens up to here are already in the text

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        after = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""  # nothing printable yet (special token or a partial character)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]


class StopText:
    """Accumulates text; releases what is safe to show, cutting at the first stop string."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.text = ""
        self.released = 0  # characters of `text` already handed out
        self.stopped = False

    def push(self, piece: str) -> str:
        """Add `piece`; return the newly releasable text (sets `stopped` at a stop string)."""
        if self.stopped:
            return ""
        start = max(0, self.released - max((len(s) for s in self.stop), default=0))
        self.text += piece
        cut = self._first_stop(start)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(cut)
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Everything not yet released (the sample ended without a stop string)."""
        return self._release(len(self.text))

    def _first_stop(self, start: int) -> int | None:
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self.released)
        piece = self.text[self.released : end]
        self.released = end
        return piece
