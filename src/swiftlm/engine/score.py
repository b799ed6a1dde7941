"""Scoring with a reward model: the scorer behind the server's `/v1/score` and
`swiftlm infer --task score` (`infer/score.py`).

A reward model (`swiftlm rlhf --rlhf_type rm`) is a causal LM's transformer with a one-output
`score` head, loaded as transformers' sequence classification: the reward of a conversation
is the head's output at its last token. Conversations are encoded exactly as training
encoded them (the chat template, no generation prompt), so a score here is the reward the
model learned. No generation engine is built: one batched forward pass gives the scores.

A model has a reward head when its config.json names a `...ForSequenceClassification` class
(a full rm run's final/) or its adapter is of peft's SEQ_CLS task (a LoRA rm run).
"""

import json
import threading
from pathlib import Path

import torch

from swiftlm.data.collate import collate
from swiftlm.data.columns import given, refuse_media_parts
from swiftlm.data.encode import encode_chat
from swiftlm.data.formats import chat_sample
from swiftlm.data.rows import RowError
from swiftlm.engine.build import InferenceModel, apply_adapters
from swiftlm.models.config import ModelArguments
from swiftlm.models.loader import (
    SEQUENCE_CLASSIFICATION,
    load_model,
    load_tokenizer,
    pick_device,
    pick_dtype,
)

ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter folder's config
MODEL_CONFIG = "config.json"  # a transformers model folder's config


# -- which models score ----------------------------------------------------------------------


def is_reward_model(spec: InferenceModel) -> bool:
    """Whether `spec` loads with a sequence-classification (reward) head."""
    if any(is_reward_adapter(folder) for folder in spec.adapters):
        return True
    return any(str(a).endswith("ForSequenceClassification") for a in _architectures(spec))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # loading reports an unreadable file with its own words
    return value if isinstance(value, dict) else {}


def is_reward_adapter(folder: str) -> bool:
    """Whether a peft adapter folder holds a reward model (peft's SEQ_CLS task, score head)."""
    return _read_json(Path(folder) / ADAPTER_CONFIG).get("task_type") == "SEQ_CLS"


def _architectures(spec: InferenceModel) -> list:
    folder = Path(spec.base_path)
    if folder.is_dir():
        return _read_json(folder / MODEL_CONFIG).get("architectures") or []
    from transformers import AutoConfig

    try:  # a hub id: its config (cached, or fetched when the hub is reachable)
        return AutoConfig.from_pretrained(spec.base_path).architectures or []
    except (OSError, ValueError):
        return []


# -- the scorer ----------------------------------------------------------------------------


class RewardScorer:
    """A reward model and its tokenizer: conversations in, one float each out.

    Thread-safe: the server's requests take turns on the model (one forward at a time)."""

    def __init__(self, model, tokenizer, max_batch_size: int = 32):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.lock = threading.Lock()

    def encode(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, as `swiftlm rlhf --rlhf_type rm` encoded it."""
        return encode_chat(self.tokenizer, messages, "last_turn")["input_ids"]

    def too_long(self, ids: list[int]) -> str | None:
        """Why `ids` cannot be scored (longer than the model's context), or None."""
        if self.max_length and len(ids) > self.max_length:
            return (
                f"the conversation has {len(ids)} tokens, more than the model's context "
                f"length of {self.max_length}; shorten it"
            )
        return None

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        """The reward of each row of token ids, in order; rows of similar length share a
        batch of at most `max_batch_size`, so little is spent on padding."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        scores = [0.0] * len(rows)
        with self.lock, torch.inference_mode():
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                for i, score in zip(chunk, self._forward([rows[i] for i in chunk]), strict=True):
                    scores[i] = score
        return scores

    def _forward(self, rows: list[list[int]]) -> list[float]:
        pad = self.tokenizer.pad_token_id
        batch = collate([{"input_ids": ids} for ids in rows], pad, {"input_ids": pad})
        output = self.model(
            input_ids=batch["input_ids"].to(self.device),
            attention_mask=batch["attention_mask"].to(self.device),
            use_cache=False,
        )
        return output.logits[:, 0].float().tolist()

    def shutdown(self) -> None:
        """Nothing runs in the background (the engine's counterpart, for `swiftlm deploy`)."""


def load_scorer(spec: InferenceModel, model_args: ModelArguments, max_batch_size: int = 32):
    """The reward model of `spec` (its adapters, score head included, merged in)."""
    device = pick_device(model_args.device)
    dtype = pick_dtype(spec.torch_dtype, device)
    tokenizer = load_tokenizer(spec.tokenizer_path)
    pad = tokenizer.pad_token_id
    model = load_model(
        spec.base_path, dtype, device, model_args.attn_impl, None, SEQUENCE_CLASSIFICATION, pad
    )
    model = apply_adapters(model, spec.adapters)
    model.config.pad_token_id = pad  # the head finds each row's end by it, as in training
    return RewardScorer(model, tokenizer, max_batch_size)


# -- the conversations it scores ----------------------------------------------------------


def score_sample(record: dict, system: str | None = None) -> dict:
    """A conversation to score: any chat format of SFT, or TRL's `prompt` (a string or a
    message list) with the answer in `response` or `completion`; it must end with the answer."""
    if given(record.get("prompt")):
        record = _prompt_and_answer(record)
    sample = chat_sample(record, require_answer=False, system=system, method="infer --task score")
    messages = sample["messages"]
    refuse_media_parts(messages, "infer --task score")
    if "tools" in sample or any(m.get("tool_calls") for m in messages):
        raise RowError(
            "tool calls", "the row has tools or tool calls, which scoring does not render yet"
        )
    if messages[-1]["role"] != "assistant":
        raise RowError(
            "no answer",
            f"the conversation ends with a {messages[-1]['role']} message; --task score scores "
            "the answer, so it must end with an assistant message",
        )
    return {"messages": messages}


def _prompt_and_answer(record: dict) -> dict:
    prompt = record["prompt"]
    answer = record.get("response", record.get("completion"))
    if not given(answer):
        raise RowError("no answer", "`prompt` is given without the answer to score: add `response`")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    answer = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else answer
    if not isinstance(prompt, list) or not isinstance(answer, list):
        raise RowError("bad field type", "`prompt` and `response` must be strings or message lists")
    return {"messages": [*prompt, *answer]}
