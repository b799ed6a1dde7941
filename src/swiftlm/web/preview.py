"""The data tab's preview: the first rows of each dataset as the method reads them, and the
bad rows among the rows read as `file:line: reason`, from swiftlm's own readers and the
method's row schema (`to_sample`), the same code that validates data before a run's first step.
"""

import itertools
from types import SimpleNamespace

from swiftlm.data.loading import LoadReport, checked_sample
from swiftlm.data.sources import parse_dataset_spec, read_rows
from swiftlm.errors import SwiftLMError
from swiftlm.methods.registry import METHODS

PREVIEW_ROWS = 5  # shown per dataset
CHECKED_ROWS = 2000  # rows validated per dataset for the error list (a preview, not a run)
LISTED_ERRORS = 20


def method_name(command: str, cfg) -> str:
    return cfg.rlhf.rlhf_type if command == "rlhf" else command


def row_schema(command: str, cfg):
    """The method's `to_sample`. Building a method needs only the tokenizer's pad id, which
    the row schema does not use: a stand-in keeps the preview free of any model loading."""
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    return METHODS[method_name(command, cfg)](cfg, tokenizer).to_sample


def preview_dataset(spec: str, to_sample) -> dict:
    """{"dataset", "rows": first PREVIEW_ROWS samples, "errors": ["file:line: reason"],
    "checked": rows read}; a dataset that cannot be read at all gives {"dataset", "error"}."""
    path, _ = parse_dataset_spec(spec)
    report = LoadReport()
    rows, checked = [], 0
    try:
        for row in itertools.islice(read_rows(path), CHECKED_ROWS):
            checked += 1
            sample = checked_sample(row, to_sample, report)
            if sample is not None and len(rows) < PREVIEW_ROWS:
                rows.append(sample)
    except SwiftLMError as exc:
        return {"dataset": spec, "error": str(exc)}
    errors = [f"{bad.source}:{bad.line}: {bad.reason}" for bad in report.bad_rows]
    return {"dataset": spec, "rows": rows, "errors": errors[:LISTED_ERRORS], "checked": checked}


def preview(command: str, cfg) -> list[dict]:
    """The preview of every training and validation dataset of a parsed config."""
    to_sample = row_schema(command, cfg)
    specs = [*cfg.data.dataset, *cfg.data.val_dataset]
    return [preview_dataset(spec, to_sample) for spec in specs]
