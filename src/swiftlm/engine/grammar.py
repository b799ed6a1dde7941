"""Constrained decoding with xgrammar: a grammar masks a row's logits before sampling.

`Grammars(tokenizer, stop_token_ids)` compiles grammars for one tokenizer (JSON, a JSON schema,
a JSON schema between literal tags for tool calls); each compiled `GrammarConstraint` goes on a
`GenerationRequest` as its `constraint`, and every sample of that request gets its own
`GrammarRowMatcher` (its own parser state). The engine calls `mask` on the row's raw logits
(before penalties, temperature and truncation, so whatever sampling keeps is always allowed),
then `accept` with the sampled token; once the grammar has accepted a stop token it is
terminated and the sample ends with "stop".

xgrammar is imported lazily: it is an optional dependency (`pip install swiftlm[serve]`), and
requests without a constraint never touch it.
"""

import json
import threading

import torch


def _xgrammar():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "structured output needs xgrammar: pip install 'swiftlm[serve]' (or xgrammar)"
        ) from None
    return xgrammar


class GrammarRowMatcher:
    """One sample's parser state: which tokens may come next, and what has been accepted."""

    def __init__(self, compiled, vocab_size: int):
        xgr = _xgrammar()
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids now to -inf, in place; `logits` is one
        row [vocab] (the model's vocabulary may be padded beyond the tokenizer's)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        row = logits.view(1, -1)
        self._xgr.apply_token_bitmask_inplace(row[:, : self._vocab_size], self._bitmask)
        if row.shape[-1] > self._vocab_size:
            row[:, self._vocab_size :] = float("-inf")  # padding ids are no tokens at all

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (then nothing changed)."""
        return self._matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class GrammarConstraint:
    """A compiled grammar; `matcher()` starts a fresh parse for one sample."""

    def __init__(self, compiled, vocab_size: int, description: str):
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.description = description  # for logs and errors: "json_schema 'person'"

    def matcher(self) -> GrammarRowMatcher:
        return GrammarRowMatcher(self.compiled, self.vocab_size)

    @property
    def ebnf(self) -> str:
        """The grammar as EBNF text (its root rule `root`): how another engine that enforces
        grammars itself (vLLM's structured outputs) receives the same one."""
        return str(self.compiled.grammar)


class Grammars:
    """Compiles grammars for one tokenizer. Thread-safe: the server compiles off the event
    loop, possibly for several requests at once (xgrammar caches compiled schemas itself)."""

    def __init__(self, tokenizer, stop_token_ids):
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab_size = len(tokenizer)
        # The engine's end-of-turn ids: the grammar ends the answer with one of them, which the
        # engine then treats as the end of the sample.
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self.info)
        self._lock = threading.Lock()

    def _constraint(self, compile_, description: str) -> GrammarConstraint:
        with self._lock:
            compiled = compile_()
        return GrammarConstraint(compiled, self.vocab_size, description)

    def json_object(self) -> GrammarConstraint:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        schema = json.dumps({"type": "object"})
        return self._constraint(
            lambda: self._compiler.compile_json_schema(schema, any_whitespace=False), "json_object"
        )

    def json_schema(self, schema: dict, strict: bool = True) -> GrammarConstraint:
        """JSON valid against `schema`; raises ValueError naming what xgrammar refused.
        Whitespace is fixed (no free indentation): a random or weak model could otherwise
        fill its whole budget with spaces and newlines."""
        text = json.dumps(schema)
        try:
            return self._constraint(
                lambda: self._compiler.compile_json_schema(
                    text, any_whitespace=False, strict_mode=strict
                ),
                "json_schema",
            )
        except Exception as exc:
            raise ValueError(f"the JSON schema cannot be compiled: {exc}") from None

    def tagged_json(self, schema: dict, begin: str, end: str) -> GrammarConstraint:
        """`begin`, JSON valid against `schema`, `end`: one tool call in a tagged format such
        as Hermes' `<tool_call>\\n{...}\\n</tool_call>`."""
        xgr = self._xgr
        try:
            body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception as exc:
            raise ValueError(f"a tool's parameters schema cannot be compiled: {exc}") from None
        grammar = xgr.Grammar.concat(
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(begin)}"),
            body,
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(end)}"),
        )
        return self._constraint(lambda: self._compiler.compile_grammar(grammar), "tool_call")
