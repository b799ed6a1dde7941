"""Read raw rows from dataset specs: local files, folders, built-in datasets and hub datasets.

A spec is `path`, `path#N` (take N samples), `swiftlm/<built-in name>`, or a hub id
`name` / `name:subset`. Every row carries the file and 1-based line where it starts, so
later errors can point at `file:line`. Rows that cannot be parsed are yielded with
`error` set instead of raising, so one pass can report all bad rows of a file.
"""

from __future__ import annotations

import csv
import importlib.resources
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftlm.errors import DataError

if TYPE_CHECKING:
    from swiftlm.data.config import DataArguments

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet", ".txt")

BUILTIN_DATASETS = {
    "swiftlm/self-cognition": "self_cognition.jsonl",
    # ms-swift's name for the same kind of data ({{NAME}}/{{AUTHOR}} from --model_name/_author)
    "swift/self-cognition": "self_cognition.jsonl",
    "swiftlm/general-qa": "general_qa.jsonl",
    # Preference pairs for swiftlm rlhf and their held-out prompts (scripts/make_preference_data.py)
    "swiftlm/concise-preference": "concise_preference.jsonl",
    "swiftlm/concise-heldout": "concise_heldout.jsonl",
    # GRPO's verifiable task: additions with a `solution` (scripts/make_arithmetic_data.py)
    "swiftlm/arithmetic": "arithmetic.jsonl",
    "swiftlm/arithmetic-heldout": "arithmetic_heldout.jsonl",
    # Evaluation sets of `swiftlm eval` (swiftlm/quick), written for the project: questions
    # and self-cognition probes that the default job's training data does not contain.
    "swiftlm/general-qa-eval": "general_qa_eval.jsonl",
    "swiftlm/self-cognition-probes": "self_cognition_probes.jsonl",
}

NOT_AN_OBJECT = "expected a JSON object"


@dataclass(frozen=True)
class RawRow:
    """One row as read: `record` is the parsed object, or None with `error` saying why."""

    source: str
    line: int
    record: dict | None
    error: str | None = None


def parse_dataset_spec(spec: str) -> tuple[str, int | None]:
    """Split `path#N` into (path, N); a spec without `#` gives (spec, None)."""
    path, sep, count = spec.rpartition("#")
    if not sep or os.path.exists(spec):
        path, count = spec, ""
    elif not (count.isdigit() and int(count) > 0):
        raise DataError(
            f"bad dataset spec {spec!r}: the part after '#' must be a positive whole number "
            "of samples, e.g. data.jsonl#500"
        )
    if not path.strip():
        raise DataError(f"bad dataset spec {spec!r}: no path or dataset name")
    return path, (int(count) if count else None)


def builtin_dataset_path(name: str) -> Path:
    """Path of a built-in dataset file (see BUILTIN_DATASETS) inside the installed package."""
    resource = importlib.resources.files("swiftlm") / "assets" / BUILTIN_DATASETS[name]
    return Path(str(resource))


def read_rows(path: str) -> Iterator[RawRow]:
    """Yield the rows of one dataset (a spec without `#N`), in file order.

    Raises DataError for a missing or unsupported file, a `.json`/`.csv` file that cannot
    be parsed as a whole, or a hub dataset that cannot be loaded.
    """
    local = os.path.expanduser(path)
    if path in BUILTIN_DATASETS:
        builtin = builtin_dataset_path(path)
        if not builtin.is_file():
            raise DataError(f"built-in dataset {path!r} is missing from the install: {builtin}")
        yield from _read_file(builtin, source=path)
    elif os.path.isdir(local):
        yield from _read_directory(path)
    elif os.path.isfile(local):
        yield from _read_file(Path(local), source=path)
    elif _looks_like_local_path(path):
        raise DataError(f"dataset file not found: {path}")
    else:
        yield from _read_hub(path)


def _looks_like_local_path(path: str) -> bool:
    # A hub id never starts like a filesystem path nor ends with a file extension, so a
    # typo in a local path gets a "not found" error rather than a confusing hub lookup.
    return path.startswith(("/", ".", "~")) or path.lower().endswith(SUPPORTED_EXTENSIONS)


def check_dataset_paths(data: DataArguments) -> None:
    """Raise a DataError naming the first local --dataset / --val_dataset path that does not
    exist (`swiftlm infer` and `export` read their datasets after the model loads; a training run
    checks before it loads anything). The reader's own test of local path vs hub id decides,
    so that a path it would call missing is named before anything loads."""
    for flag, specs in (("--dataset", data.dataset), ("--val_dataset", data.val_dataset)):
        for spec in specs:
            _check_dataset(spec, flag)


def _check_dataset(spec: str, flag: str) -> None:
    """A local dataset path must exist; a hub id is looked up when the data is read."""
    path, _ = parse_dataset_spec(spec)
    local = os.path.expanduser(path)
    if path in BUILTIN_DATASETS or os.path.exists(local) or not _looks_like_local_path(path):
        return
    raise DataError(
        f"{flag} {path}: no such file or folder (looked for {Path(local).resolve()}); check the "
        "path, or give a hub dataset id"
    )


def _read_directory(path: str) -> Iterator[RawRow]:
    """The rows of every data file under a folder, subfolders included, in sorted path order.

    Hidden entries (a name starting with '.', e.g. `.git`, `.gitattributes`) and dataset cards
    (README and LICENSE files, as in a cloned hub dataset) are not data and are passed over.
    Any other file swiftlm cannot read is refused by name, so no file is skipped silently.
    """
    folder = Path(os.path.expanduser(path))
    files = sorted(_folder_files(folder), key=lambda file: file.relative_to(folder).parts)
    unreadable = [f for f in files if not f.name.lower().endswith(SUPPORTED_EXTENSIONS)]
    if unreadable:
        names = ", ".join(f.relative_to(folder).as_posix() for f in unreadable[:10])
        more = f" and {len(unreadable) - 10} more" if len(unreadable) > 10 else ""
        raise DataError(
            f"dataset folder {path} holds files swiftlm does not read: {names}{more}; "
            f"supported: {', '.join(SUPPORTED_EXTENSIONS)}. Move them out of the folder, or "
            "pass the data files themselves to --dataset"
        )
    if not files:
        raise DataError(
            f"dataset folder {path} has no data files; expected files ending in "
            f"{', '.join(SUPPORTED_EXTENSIONS)}"
        )
    for file in files:
        yield from _read_file(file, source=os.path.join(path, *file.relative_to(folder).parts))


# File stems of dataset cards: a hub dataset's README.md, LICENSE, LICENSE.txt ...
DATASET_CARDS = ("readme", "license", "licence")


def _folder_files(folder: Path, seen: frozenset = frozenset()) -> Iterator[Path]:
    """Every file under `folder`, hidden entries and dataset cards excepted."""
    seen = seen | {folder.resolve()}  # a symlink back up the tree is not followed twice
    for entry in folder.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            if entry.resolve() not in seen:
                yield from _folder_files(entry, seen)
        elif entry.is_file() and entry.stem.lower() not in DATASET_CARDS:
            yield entry


def _read_file(path: Path, source: str) -> Iterator[RawRow]:
    readers = {
        ".jsonl": _read_jsonl,
        ".json": _read_json,
        ".csv": _read_csv,
        ".parquet": _read_parquet,
        ".txt": _read_txt,
    }
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{source}: unsupported dataset file type {path.suffix!r}; supported: "
            f"{', '.join(SUPPORTED_EXTENSIONS)}"
        )
    yield from reader(path, source)


def _read_jsonl(path: Path, source: str) -> Iterator[RawRow]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            # Decode per line so one bad byte costs one row, not the whole file.
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield RawRow(source, number, None, f"invalid JSON: not UTF-8 text ({e.reason})")
                continue
            if line.strip():
                yield _parse_json_line(line, source, number)


def _parse_json_line(line: str, source: str, number: int) -> RawRow:
    try:
        # Without the line break, an error at the end of the line reports its real column.
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        return RawRow(source, number, None, f"invalid JSON: {e.msg} at column {e.colno}")
    if not isinstance(record, dict):
        return RawRow(source, number, None, NOT_AN_OBJECT)
    return RawRow(source, number, record)


def _read_json(path: Path, source: str) -> Iterator[RawRow]:
    text = decode_text_file(path.read_bytes(), source)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):
            # JSON Lines saved with a .json name: read it line by line instead.
            yield from _read_jsonl(path, source)
            return
        raise DataError(f"{source}:{e.lineno}: invalid JSON: {e.msg} at column {e.colno}") from e
    start = _array_offset(text, data, source)
    yield from _array_rows(text, start, source)


def _array_offset(text: str, data: Any, source: str) -> int:
    """Offset of the `[` of the row array: the top level, or the one list in a top object."""
    if isinstance(data, list):
        return _skip_space(text, 0)
    list_keys = (
        [k for k, v in data.items() if isinstance(v, list)] if isinstance(data, dict) else []
    )
    if len(list_keys) != 1:
        raise DataError(
            f"{source}:1: expected a JSON array of objects, or an object holding one list "
            'of them such as {"data": [...]}'
        )
    # Walk the top object's members (the text is valid JSON) to find where the list starts.
    decoder = json.JSONDecoder()
    index = _skip_space(text, _skip_space(text, 0) + 1)  # past '{'
    while True:
        key, index = decoder.raw_decode(text, index)
        index = _skip_space(text, _skip_space(text, index) + 1)  # past ':'
        if key == list_keys[0]:
            return index
        _, index = decoder.raw_decode(text, index)
        index = _skip_space(text, _skip_space(text, index) + 1)  # past ','


def _array_rows(text: str, index: int, source: str) -> Iterator[RawRow]:
    """Yield the elements of the (already validated) JSON array starting at text[index]."""
    decoder = json.JSONDecoder()
    line, counted_to = 1, 0
    index = _skip_space(text, index + 1)
    while text[index] != "]":
        line += text.count("\n", counted_to, index)
        counted_to = index
        element, index = decoder.raw_decode(text, index)
        if isinstance(element, dict):
            yield RawRow(source, line, element)
        else:
            yield RawRow(source, line, None, NOT_AN_OBJECT)
        index = _skip_space(text, index)
        if text[index] == ",":
            index = _skip_space(text, index + 1)


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\n\r":
        index += 1
    return index


def _read_csv(path: Path, source: str) -> Iterator[RawRow]:
    reader = csv.reader(io.StringIO(decode_text_file(path.read_bytes(), source), newline=""))
    try:
        header = next(reader)
    except StopIteration:
        return
    line_before = reader.line_num
    for cells in reader:
        # A quoted cell may span lines: the row starts right after the previous one ended.
        start, line_before = line_before + 1, reader.line_num
        if not cells:
            continue
        if len(cells) > len(header):
            error = f"invalid CSV: row has {len(cells)} cells but the header has {len(header)}"
            yield RawRow(source, start, None, error)
            continue
        # Empty and absent trailing cells mean "missing", so optional fields may be blank.
        record = {key: value for key, value in zip(header, cells, strict=False) if value != ""}
        yield RawRow(source, start, record)


def _read_parquet(path: Path, source: str) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowIOError / ArrowInvalid
        raise DataError(f"{source}: cannot read parquet file: {e}") from e
    number = 0
    for batch in table.iter_batches():
        for record in batch.to_pylist():
            number += 1
            yield RawRow(source, number, record)


def _read_txt(path: Path, source: str) -> Iterator[RawRow]:
    yield RawRow(source, 1, {"text": decode_text_file(path.read_bytes(), source)})


def decode_text_file(data: bytes, source: str) -> str:
    """A .txt file's bytes as text (a BOM dropped); not UTF-8 is a DataError at its line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{source}:{line}: not UTF-8 text ({e.reason})") from None


def _read_hub(spec: str) -> Iterator[RawRow]:
    import datasets

    name, _, subset = spec.partition(":")
    try:
        dataset = datasets.load_dataset(name, subset or None, split="train")
    except Exception as e:  # offline, unknown repo, missing split: all mean "can't use it"
        raise DataError(
            f"dataset {spec!r} is neither a local file nor reachable on the Hugging Face Hub "
            f"({type(e).__name__}: {e}). Check the path; hub datasets need a network "
            "connection or a copy in the local cache."
        ) from e
    for index, record in enumerate(dataset):
        yield RawRow(spec, index + 1, dict(record))
