"""Sampled completions in one packed row, for the trainer's forwards (`--padding_free`).

`completion_rows` (rollout.py) lays out prompt + completion per row, right-padded: the
layout the losses read (labels, advantages, the engine's log-probs, per row). Forwarding
that layout computes every prompt once per completion and every padding column. Here a
micro-batch's completions go into one row instead:

- shared prompt (attention `swiftlm_varlen`, the CPU default): `[prompt + c1][c2]...[cG]`
  per prompt, each c_i at the positions after the prompt, so the varlen attention reads
  c_2..c_G as forks of the prompt (models/attention.py) and the prompt is computed once;
- one segment per completion (any attention that reads packed position ids, e.g.
  flash-attention's varlen kernel, which has no forks): `[prompt + c_i]` each, positions
  restarting at 0.

Only the positions that predict a completion token reach the LM head (`logits_to_keep`
with their indices), so no [tokens, vocab] logits of the prompts are made. The log-probs
come back in the padded layout ([rows, width], 0 off the labels), so every loss, mask and
metric reads them as it reads the padded forward's.
"""

import contextlib

import torch
import torch.nn.functional as F

# Batch entries of the packed forward (the padded layout's labels etc. stay beside them).
SCORED = ("score_positions", "score_tokens", "score_slots")


def packed_completion_row(
    prompts: list[list[int]], completions: list[list[int]], width: int, share_prompt: bool
) -> dict[str, torch.Tensor]:
    """The packed forward of completions whose padded layout is [rows, width] (row i =
    prompts[i] + completions[i]; consecutive rows with the same prompt ids share it when
    `share_prompt`; an empty completion is left out): input_ids, position_ids and token_mask
    [1, T]; per completion token, the packed position whose logits predict it, the token,
    and its flat index in the padded layout (row * width + shifted column)."""
    ids: list[int] = []
    positions: list[int] = []
    scored: dict[str, list[int]] = {name: [] for name in SCORED}
    last_prompt_end = None  # packed index of the shared prompt's last token
    previous = None  # the prompt of the last completion laid out
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        if not completion:  # nothing to score
            continue
        if not (share_prompt and prompt == previous):
            ids += prompt
            positions += range(len(prompt))
            last_prompt_end, previous = len(ids) - 1, prompt
        start = len(ids)
        ids += completion
        positions += range(len(prompt), len(prompt) + len(completion))
        # Token j is predicted by the one before it: the prompt's last, then c[j - 1].
        scored["score_positions"] += [last_prompt_end, *range(start, len(ids) - 1)]
        scored["score_tokens"] += completion
        first = row * width + len(prompt) - 1
        scored["score_slots"] += range(first, first + len(completion))
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "token_mask": torch.ones((1, len(ids)), dtype=torch.long),
        **{name: torch.tensor(values, dtype=torch.long) for name, values in scored.items()},
    }


def packed_token_logps(model, batch, temperature: float, context=None) -> torch.Tensor:
    """Per position of the padded layout ([rows, width] of batch["labels"]), the log-prob of
    the next label token under logits / temperature (float32, 0 off the labels), from one
    forward of the packed row."""
    with context or contextlib.nullcontext():
        logits = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            logits_to_keep=batch["score_positions"],
            use_cache=False,
        ).logits[0]
    tokens = batch["score_tokens"]
    logps = -F.cross_entropy(logits.float() / temperature, tokens, reduction="none")
    labels = batch["labels"]
    placed = logps.new_zeros(labels.numel()).index_put((batch["score_slots"],), logps)
    return placed.view(labels.shape)
