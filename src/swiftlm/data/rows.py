"""RowError: what a row schema raises for one dataset row it cannot use.

Loading reports each as `file:line: reason` (or skips and counts it by `kind` under
--skip_bad_rows). It lives apart from `formats` so that the modules `formats` builds on
(tool calls, column rules) can raise it too; `swiftlm.data.formats.RowError` is the same class.
"""

ROW_ERROR_KINDS = (
    "invalid JSON",
    "invalid CSV",
    "not an object",
    "no recognizable format",
    "two layouts",
    "unknown role",
    "empty content",
    "empty assistant answer",
    "wrong role order",
    "no answer",
    "empty text",
    "bad field type",
    "bad content part",
    "conflicting system",
    "bad tool call",
    "tool calls",
    "media",
    "bad image",
    "image tags",
    "column for another method",
)


class RowError(ValueError):
    """One dataset row that cannot be used; `kind` is one of ROW_ERROR_KINDS."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def type_name(value) -> str:
    """How a row's value is named in messages: JSON's `null` for None, else the Python type."""
    return "null" if value is None else type(value).__name__


def message_loss(value, role: str, where: str) -> bool:
    """ms-swift's per-message `loss` key: whether this assistant turn is trained, whatever
    --loss_scope would choose for it (data/encode.py applies it)."""
    if role != "assistant":
        raise RowError(
            "bad field type", f"{where} has 'loss'; only assistant turns carry loss: remove it"
        )
    if not isinstance(value, bool):
        raise RowError(
            "bad field type", f"{where} 'loss' must be true or false, got {type_name(value)}"
        )
    return value
