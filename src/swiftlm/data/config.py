"""The config section of the data a command reads: datasets and their mix, validation split,
lengths and truncation, the system prompt, loss scope, bad rows, caching, streaming and
images. Same conventions as `config/sections.py`: field names are the flag names, each
field's `help` is its `--help` text, the section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import at_least, check_fields, within
from swiftlm.config.sections import doc


@dataclass
class DataArguments:
    dataset: list[str] = doc(
        "Training data: local .jsonl/.json/.csv/.parquet/.txt files or hub ids; several are "
        "mixed. `path#N` takes N samples. Default: the built-in self-cognition mix.",
        default_factory=list,
    )
    val_dataset: list[str] = doc("Validation data, same forms as --dataset.", default_factory=list)
    split_dataset_ratio: float = doc(
        "Fraction of --dataset held out for validation when --val_dataset is not given.",
        default=0.0,
    )
    max_length: int = doc("Longest sample in tokens (prompt + answer).", default=2048)
    truncation_strategy: Literal["delete", "left", "right"] = doc(
        "Over-long samples: delete them, or cut tokens from the left or the right.",
        default="delete",
    )
    system: str | None = doc("System prompt added to conversations that have none.", default=None)
    loss_scope: Literal["assistant", "last_turn", "all"] = doc(
        "Tokens that carry loss: every assistant turn, the last assistant turn, or all tokens.",
        default="assistant",
    )
    skip_bad_rows: bool = doc(
        "Skip invalid rows (and print counts by reason) instead of stopping before training.",
        default=False,
    )
    data_seed: int = doc("Seed for sampling, mixing and splitting datasets.", default=42)
    load_from_cache_file: bool = doc(
        "Reuse the tokenized dataset cached (Arrow) by an earlier run with the same files, "
        "tokenizer and data options; false re-tokenizes.",
        default=True,
    )
    max_pixels: int = doc(
        "Vision-language models: images with more pixels than this are scaled down (aspect "
        "kept) before the processor; 0 keeps the processor's own limits.",
        default=0,
    )
    dataset_num_proc: int = doc(
        "SFT: processes that tokenize conversations (text models) or decode and preprocess "
        "images (vision-language models) on a cache miss (spawned, each with the tokenizer "
        "or processor); pt: processes that tokenize local .jsonl/.txt files into token shards "
        "(spawned); 1 encodes in the main process.",
        default=1,
    )
    streaming: bool = doc(
        "pt: read and tokenize local .jsonl/.txt data while training, in file order (see "
        "--shuffle_buffer_size), never cached; a resume seeks to the saved byte offset. Needs "
        "--max_steps.",
        default=False,
    )
    shuffle_buffer_size: int = doc(
        "pt --streaming true: shuffle the chunks within consecutive windows of this many "
        "(seeded by --data_seed; a resume re-reads at most one window); 0 keeps file order.",
        default=0,
    )

    def __post_init__(self):
        check_fields(
            self,
            split_dataset_ratio=within(0, 1, note="the fraction held out", open_high=True),
            max_length=at_least(2),
            max_pixels=at_least(0),
            dataset_num_proc=at_least(1),
            shuffle_buffer_size=at_least(0),
        )
