"""An example swiftlm plugin (installed: entry point `demo`; or as a file:
`--external_plugins path/to/swiftlm_demo_plugin/__init__.py`).

It registers
- the dataset format `demo_qa`: rows `{"q": question, "a": answer}` (detected by their keys);
- the loss `demo_focal` (`swiftlm sft --loss_type demo_focal`): focal loss, gamma 2;
- the reward function `demo_brevity` (`swiftlm rlhf --rlhf_type grpo --reward_funcs
  demo_brevity`): minus the completion's length in characters over 100;
- the callback `demo_events`: writes each training event as a JSON line to the file named by
  the environment variable SWIFTLM_DEMO_EVENTS (does nothing without it).
"""

import json
import os

import torch

import swiftlm.plugins as plugins

SWIFTLM_API_VERSION = "1.0"
FOCAL_GAMMA = 2.0


def is_qa_row(row: dict) -> bool:
    return isinstance(row.get("q"), str) and isinstance(row.get("a"), str)


def qa_to_messages(row: dict) -> dict:
    """`{"q", "a"}` -> swiftlm's canonical chat row."""
    if not row.get("a", "").strip():
        raise plugins.RowError("empty assistant answer", "demo_qa: the row's 'a' is empty")
    return {
        "messages": [
            {"role": "user", "content": row["q"]},
            {"role": "assistant", "content": row["a"]},
        ]
    }


def focal_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over label tokens of -(1 - p)^gamma * log p, p the target token's probability."""
    mask = targets != -100
    log_probs = torch.log_softmax(logits, dim=-1)
    target_log_probs = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    weights = (1 - target_log_probs.exp()) ** FOCAL_GAMMA
    return -(weights * target_log_probs)[mask].sum()


def brevity(completions: list[str], **kwargs) -> list[float]:
    """Shorter is better: -len(completion) / 100 per completion."""
    return [-len(text) / 100 for text in completions]


class EventLog:
    """Appends {"event", ...} JSON lines to $SWIFTLM_DEMO_EVENTS."""

    def _write(self, event: str, **fields) -> None:
        path = os.environ.get("SWIFTLM_DEMO_EVENTS")
        if path:
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps({"event": event, **fields}, default=str) + "\n")

    def on_train_start(self, run_dir, step, num_steps):
        self._write("on_train_start", run_dir=str(run_dir), step=step, num_steps=num_steps)

    def on_step_end(self, step, loss, learning_rate, grad_norm):
        self._write("on_step_end", step=step, loss=loss, learning_rate=learning_rate)

    def on_save(self, step, path):
        self._write("on_save", step=step, path=str(path))

    def on_train_end(self, step, summary):
        self._write("on_train_end", step=step, final_loss=summary.get("final_train_loss"))


def register() -> None:
    plugins.require_api("1.0")
    plugins.register_dataset_format("demo_qa", qa_to_messages, detect=is_qa_row)
    plugins.register_loss("demo_focal", focal_loss)
    plugins.register_reward("demo_brevity", brevity)
    plugins.register_callback("demo_events", EventLog)
