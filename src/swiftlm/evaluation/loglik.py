"""Log-likelihoods under a local model: perplexity of texts, and of each answer choice.

Both run the model forward in batches (right-padded, fp32 log-softmax over the vocabulary),
in inference mode, and return plain floats, so a task's scores do not depend on the batch
size beyond floating-point summation order.

- `text_nll`: the summed negative log-likelihood of every token of a text after its first
  (nothing predicts the first token), as `transformers` computes it with `labels=input_ids`.
  A text longer than the model's context is cut into windows of `max_length` tokens that
  overlap by one token: each token is predicted once, with the window's tokens before it as
  context (lm-eval's rolling windows with a one-token context).
- `continuation_logprobs`: for (context, continuation) pairs, the summed log-probability of
  the continuation's tokens after the context, and whether each was the greedy choice. The
  pair is tokenized as a whole and the continuation is what follows the context's tokens, so
  a tokenizer that merges across the boundary is handled as lm-eval's HF backend does.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TextNll:
    nll: float  # summed over the predicted tokens, in nats
    tokens: int  # tokens predicted


def text_nll(
    model, tokenizer, texts: list[str], max_length: int, batch_size: int = 8
) -> list[TextNll]:
    windows: list[tuple[int, list[int]]] = []  # (text index, window tokens)
    for index, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"]
        windows += [(index, w) for w in _windows(ids, max_length)]
    totals = [[0.0, 0] for _ in texts]
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        rows = [w for _, w in chunk]
        scored = _token_logprobs(model, tokenizer, rows, [1] * len(rows))
        for (index, window), (logprobs, _) in zip(chunk, scored, strict=True):
            totals[index][0] -= sum(logprobs)
            totals[index][1] += len(window) - 1
    return [TextNll(nll, tokens) for nll, tokens in totals]


def _windows(ids: list[int], max_length: int) -> list[list[int]]:
    """Windows of at most `max_length` tokens, each sharing one token with the one before."""
    if len(ids) <= max_length:
        return [ids] if len(ids) > 1 else []
    step = max_length - 1
    return [ids[s : s + max_length] for s in range(0, len(ids) - 1, step)]


@dataclass(frozen=True)
class ContinuationScore:
    logprob: float
    is_greedy: bool
    tokens: int


def continuation_logprobs(
    model, tokenizer, pairs: list[tuple[str, str]], max_length: int, batch_size: int = 8
) -> list[ContinuationScore]:
    encoded = [_encode_pair(tokenizer, context, continuation) for context, continuation in pairs]
    results: list[ContinuationScore] = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        rows, firsts = [], []
        for context, continuation in chunk:
            whole = (context + continuation)[-max_length:]  # cut the context from the left
            rows.append(whole)
            firsts.append(len(whole) - len(continuation))
        for logprobs, greedy in _token_logprobs(model, tokenizer, rows, firsts):
            results.append(ContinuationScore(sum(logprobs), all(greedy), len(logprobs)))
    return results


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    # Trailing spaces of the context belong to the continuation (" Paris", not "Paris"), and
    # the pair is tokenized whole so the continuation's tokens are those the model would see.
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation)["input_ids"]
    context_ids = tokenizer(context)["input_ids"]
    return whole[: len(context_ids)], whole[len(context_ids) :]


@torch.inference_mode()
def _token_logprobs(model, tokenizer, rows: list[list[int]], firsts: list[int]):
    """For each row, the log-probs of its tokens from index `first` on, and whether each was
    the argmax. One forward pass over the right-padded batch."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, device=device)
        mask[i, : len(row)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    log_probs = F.log_softmax(logits, dim=-1)
    out = []
    for i, (row, first) in enumerate(zip(rows, firsts, strict=True)):
        first = max(first, 1)
        targets = torch.tensor(row[first:], device=device)
        predicted = log_probs[i, first - 1 : len(row) - 1]
        picked = predicted.gather(1, targets[:, None])[:, 0]
        greedy = predicted.argmax(dim=-1) == targets
        out.append((picked.tolist(), greedy.tolist()))
    return out
