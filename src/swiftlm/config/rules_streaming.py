"""Rules of `swiftlm pt --streaming true` (see rules.py): a stream has no known length, is
read once in file order by one process, and is never held whole."""

import re

from swiftlm.config.checks import Rule
from swiftlm.train.config import AUTO_BATCH_SIZE


def _sampled(specs: list[str]) -> str | None:
    """The first `path#N` spec (N samples drawn from the whole data), None when none."""
    return next((spec for spec in specs if re.search(r"#\d+$", spec)), None)


STREAMING_RULES = (
    Rule(
        "shuffle_buffer_needs_streaming",
        lambda c, f: c.data.shuffle_buffer_size > 0 and not c.data.streaming,
        "--shuffle_buffer_size shuffles a stream (--streaming true); without it the chunks "
        "are shuffled whole every epoch: drop --shuffle_buffer_size or add --streaming true",
    ),
    Rule(
        "streaming_needs_max_steps",
        lambda c, f: c.data.streaming and c.train.max_steps <= 0,
        "--streaming true: a stream's length is not known before it is read, so epochs "
        "cannot be counted; give the run's length with --max_steps N",
    ),
    Rule(
        "streaming_one_process",
        lambda c, f: c.data.streaming and f.world_size > 1,
        "--streaming true reads the stream in one process; this job has {world_size}: use "
        "--nproc_per_node 1 (and one node), or drop --streaming to read token shards",
    ),
    Rule(
        "streaming_fixed_batches",
        lambda c, f: (
            c.data.streaming
            and (c.train.packing or bool(c.train.padding_free) or c.train.max_tokens_per_batch > 0)
        ),
        "--streaming true cuts the stream into full --max_length chunks (nothing to pack or "
        "pad); drop --packing, --padding_free and --max_tokens_per_batch",
    ),
    Rule(
        "streaming_known_batch_size",
        lambda c, f: c.data.streaming and c.train.per_device_train_batch_size == AUTO_BATCH_SIZE,
        "--streaming true needs the batch size before training (the stream's length is "
        "--max_steps x the global batch): give --per_device_train_batch_size N, not auto",
    ),
    Rule(
        "streaming_no_split",
        lambda c, f: c.data.streaming and c.data.split_dataset_ratio > 0,
        "--split_dataset_ratio {split_dataset_ratio} holds out documents of the whole data, "
        "which --streaming true never holds; give --val_dataset instead, or drop --streaming",
    ),
    Rule(
        "streaming_no_sampling",
        lambda c, f: c.data.streaming and _sampled(c.data.dataset) is not None,
        lambda c, f: (
            f"--dataset {_sampled(c.data.dataset)}: `#N` draws samples from the whole data, "
            "which --streaming true never holds; drop the `#N`, or drop --streaming"
        ),
    ),
)
