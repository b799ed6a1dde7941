"""`swiftlm pt`: continued pre-training on plain text, with loss on every token.

Documents are joined with the EOS token and cut into --max_length chunks; the loss is the
mean next-token cross-entropy over all of them. A last chunk of one token has nothing to
predict: it is dropped, and the log says so.

Local .jsonl/.txt data is tokenized by --dataset_num_proc worker processes into memory-mapped
token shards (data.token_shards), cut into the same chunks when read; other sources (hub
datasets, `#N` sampling, .parquet/.csv/.json, --split_dataset_ratio) are read whole and
encoded by `encode`. With --streaming true local .jsonl/.txt data is read and tokenized while
training (data.streaming), in file order, never cached.
"""

from swiftlm.config import TrainConfig
from swiftlm.data.encode import encode_pretraining
from swiftlm.data.formats import text_sample
from swiftlm.data.loading import load_samples
from swiftlm.data.row_formats import ROW_FORMATS
from swiftlm.data.streaming import StreamChunks
from swiftlm.data.token_shards import load_or_build_shards, shard_blocker, spec_files
from swiftlm.errors import ConfigError
from swiftlm.methods.base import EncodeResult
from swiftlm.methods.token import NextTokenObjective


class PT(NextTokenObjective):
    name = "pt"
    default_datasets = ()  # --dataset is required

    def __init__(self, cfg: TrainConfig, tokenizer):
        super().__init__(
            tokenizer,
            cfg.train.fused_cross_entropy,
            cfg.plugins.loss_type,
            cfg.train.use_liger_kernel,
        )
        self.max_length, self.row_format = cfg.data.max_length, cfg.plugins.dataset_format

    def to_sample(self, record: dict) -> dict:
        return text_sample(record, self.row_format)

    def encode(self, samples: list[dict]) -> EncodeResult:
        texts = [s["text"] for s in samples]
        chunks, dropped = encode_pretraining(self.tokenizer, texts, self.max_length)
        # Only the last chunk can be one token long: dropped <= 1.
        note = "pt: dropped the last chunk, a single token (nothing to predict)"
        # Documents are cut into chunks, never truncated: only a one-token chunk can be dropped.
        counts = {"max_length": self.max_length, "strategy": "chunks", "dropped": dropped}
        return EncodeResult(chunks, [note] if dropped else [], counts)

    def cache_options(self) -> dict:
        options = {"method": self.name, "max_length": self.max_length}
        return {**options, "dataset_format": self.row_format} if self.row_format else options

    def sharded_data(self, cfg: TrainConfig, ctx, log) -> tuple | None:
        """(train chunks read from token shards, validation samples, truncation counts), or
        None when the data cannot be sharded (the log says why; the caller reads it whole).

        Rank 0 tokenizes (or finds the cached shards); the other ranks wait, then map them.
        With --streaming true: the chunks read while training (data.streaming)."""
        d = cfg.data
        if d.streaming:
            return self._streamed(cfg, log), self._validation(cfg, log), {}
        blocker = shard_blocker(d.dataset)
        if blocker is None and d.split_dataset_ratio > 0:
            blocker = "--split_dataset_ratio holds out documents before they are joined"
        if blocker is None and ROW_FORMATS:  # shard workers are fresh processes, without them
            blocker = "a plugin's dataset format converts the rows in this process"
        if blocker:
            log(f"pt: reading the data whole, not into token shards ({blocker})")
            return None
        options = dict(workers=d.dataset_num_proc, skip_bad_rows=d.skip_bad_rows)
        options["rebuild"] = not d.load_from_cache_file
        if ctx.is_main:
            train = load_or_build_shards(d.dataset, self.tokenizer, self.max_length, log, **options)
        ctx.broadcast_object(None)  # the other ranks wait for rank 0's shards, then map them
        if not ctx.is_main:
            train = load_or_build_shards(
                d.dataset, self.tokenizer, self.max_length, log, **options, build=False
            )
        if train.dropped:
            log("pt: dropped the last chunk, a single token (nothing to predict)")
        counts = {"max_length": self.max_length, "strategy": "chunks", "dropped": train.dropped}
        return train, self._validation(cfg, log), {"train": counts}

    def _streamed(self, cfg: TrainConfig, log) -> StreamChunks:
        """The --max_steps x global batch chunks of a run with --streaming true (one process:
        config.rules_streaming refuses more)."""
        d, t = cfg.data, cfg.train
        blocker = shard_blocker(d.dataset)
        if blocker:
            raise ConfigError(
                f"--streaming true reads local .jsonl/.txt files (or folders of them): {blocker}; "
                "pass such files, or drop --streaming"
            )
        files = [pair for spec in d.dataset for pair in spec_files(spec)]
        per_step = t.per_device_train_batch_size * t.gradient_accumulation_steps
        order = (
            f"shuffled in windows of {d.shuffle_buffer_size} chunks"
            if d.shuffle_buffer_size
            else "no shuffling"
        )
        log(
            f"streaming: {len(files)} file(s) read and tokenized while training, in file order "
            f"({order}, nothing cached): {t.max_steps} steps x {per_step} chunks of "
            f"{self.max_length} tokens"
        )
        # A checkpoint asks where the step after the prefetched ones starts: keep that many.
        window = 8 * per_step + 64
        options = dict(skip_bad_rows=d.skip_bad_rows, log=log, window=window, seed=d.data_seed)
        options["shuffle_buffer_size"] = d.shuffle_buffer_size
        return StreamChunks(
            files, self.tokenizer, self.max_length, t.max_steps * per_step, **options
        )

    def _validation(self, cfg: TrainConfig, log) -> list[dict]:
        """--val_dataset encoded in memory (validation sets are small)."""
        d = cfg.data
        if not d.val_dataset:
            return []
        options = dict(skip_bad_rows=d.skip_bad_rows, seed=d.data_seed)
        samples, report = load_samples(d.val_dataset, self.to_sample, **options)
        if report.skipped:
            log(f"--val_dataset: {report.summary()}")
        return self.encode(samples).samples
