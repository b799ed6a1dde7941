"""The batch the engine loop works on: waiting requests, one prefilling group, running rows.

One `step()` of the loop:
1. admit: if no group is prefilling, take waiting requests (FIFO) while their samples fit in
   `max_num_seqs` slots, as one left-padded group;
2. prefill one chunk of that group (at most `prefill_chunk_tokens` padded tokens), so a long
   prompt is spread over several steps and running streams keep getting tokens in between;
   when the group's prompts are all in its cache, sample each sample's first token, copy the
   rows n times for n samples, and merge them into the running batch's cache;
3. one decode step for every running row: one forward over the left-padded batch with per-row
   position ids and a 2D padding mask, per-row sampling, deltas out, finished rows dropped.
   With speculation (`speculation.py`) and a small batch, the step also checks each row's
   draft tokens in the same forward and keeps the ones its sampling agrees with.

Requests that use different adapters share the forward through peft's per-row
`adapter_names`; rows on the base model use peft's "__base__".

A sample whose preparation, sampling or detokenizing raises ends alone with finish_reason
"error" (`_fail`); its row leaves the batch and the others decode on. Only an exception of a
forward pass leaves `step()`, and the engine then aborts the whole batch.
"""

import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swiftlm.engine.detokenize import IncrementalText, StopText
from swiftlm.engine.kvcache import CACHE_KEYWORD, BatchKV
from swiftlm.engine.prefix_cache import PrefixCache, prefix_tensors
from swiftlm.engine.protocol import (
    GenerationRequest,
    InvalidRequest,
    SampleDelta,
    new_error_id,
)
from swiftlm.engine.sampling import RowState, make_generator, sample_each
from swiftlm.engine.sequence import Sequence
from swiftlm.engine.speculation import Speculation, SpeculationCounters
from swiftlm.engine.windows import WindowMasks, sliding_window

log = logging.getLogger(__name__)
BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch
# A request waits one prefill for another of its group to cache their common start when it
# is at least this long: below it, the wait costs more than prefilling the tokens twice.
DEFER_SHARED_TOKENS = 64


@dataclass
class Submitted:
    request: GenerationRequest
    on_delta: Callable[[SampleDelta], None]
    # The prompt's block digests in the prefix cache, computed once (`Scheduler._digests`).
    digests: list[bytes] | None = None


@dataclass
class PrefillGroup:
    """Requests whose prompts are being written into their own cache, chunk by chunk."""

    items: list[Submitted]
    ids: torch.Tensor  # [rows, columns], prompts left-padded
    mask: torch.Tensor  # 1 where a real token is
    positions: torch.Tensor
    kv: BatchKV
    cached: list[int]  # per row, the prompt's first tokens whose keys came from the cache
    done: int = 0  # columns already in the cache

    @property
    def samples(self) -> int:
        return sum(item.request.params.n for item in self.items)


class Scheduler:
    """Owned by the engine's loop thread: nothing here is locked."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_token_ids,
        max_num_seqs: int,
        max_model_len: int,
        prefill_chunk_tokens: int,
        adapters,
        seed: int,
        prefix_cache: PrefixCache | None = None,
        speculation: Speculation | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.adapters = frozenset(adapters)
        self.seeds = random.Random(seed)  # seeds of requests that bring none
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config.get_text_config()
        window = sliding_window(config)
        # Sliding-window layers get their window on token positions, not cache columns.
        self.window_masks = WindowMasks(config, window) if window else None
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.waiting: deque[Submitted] = deque()
        self.group: PrefillGroup | None = None
        self.running: list[Sequence] = []
        # `running_count` is read from other threads (stats): a prefilled group's samples
        # move from `group` to `running` under this lock, so they are always counted once.
        self.slots = threading.Lock()
        self.kv = BatchKV(self.num_layers, 0, self.device)
        self.prefix_cache = prefix_cache
        self.prefill_tokens = 0  # prompt tokens run through the model (not from the cache)
        self.speculation = speculation
        self.speculated = SpeculationCounters()

    # -- what there is to do --------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.group or self.running)

    def running_count(self) -> int:
        """Slots in use (the prefilling group's samples included); read by other threads."""
        with self.slots:
            group = self.group
            return len(self.running) + (group.samples if group else 0)

    def step(self) -> None:
        if self.group is None:
            self.group = self._admit()
        if self.group is not None:
            self._prefill_chunk()
        if self.running:
            self._decode()

    # -- aborts ------------------------------------------------------------------------------

    def abort(
        self, request_ids: set[str], error: str | None = None, error_id: str | None = None
    ) -> None:
        """Finish the samples of `request_ids` with "abort" and free their rows now;
        `error` says why when the engine, not the caller, ended them (logged as `error_id`)."""
        for item in [s for s in self.waiting if s.request.request_id in request_ids]:
            self.waiting.remove(item)
            _abort_submitted(item, error, error_id)
        group = self.group
        if group is not None and any(i.request.request_id in request_ids for i in group.items):
            # Finishing the prefill just to throw it away would waste work: restart the others.
            self.group = None
            kept = [i for i in group.items if i.request.request_id not in request_ids]
            self.waiting.extendleft(reversed(kept))
            for item in group.items:
                if item.request.request_id in request_ids:
                    _abort_submitted(item, error, error_id)
        for seq in self.running:
            if seq.request_id in request_ids and seq.finish_reason is None:
                self._emit(seq, seq.abort(error, error_id))
        self._drop_finished()

    def abort_all(self, error: str | None = None, error_id: str | None = None) -> None:
        ids = {s.request.request_id for s in self.waiting}
        ids |= {s.request_id for s in self.running}
        ids |= {i.request.request_id for i in self.group.items} if self.group else set()
        self.abort(ids, error, error_id)

    # -- admission and prefill -------------------------------------------------------------

    def _admit(self) -> PrefillGroup | None:
        free = self.max_num_seqs - len(self.running)
        items: list[Submitted] = []
        uncached: set[bytes] = set()  # blocks this group prefills that the cache lacks
        while self.waiting and self.waiting[0].request.params.n <= free:
            if self._shares_uncached_start(self.waiting[0], uncached):
                break  # the next group finds that prefix in the cache
            item = self.waiting.popleft()
            free -= item.request.params.n
            items.append(item)
        if not items:
            return None
        kv = BatchKV(self.num_layers, len(items), self.device)
        cached = self._cached_prefixes(items, kv)
        rests = [item.request.prompt_ids[n:] for item, n in zip(items, cached, strict=True)]
        width = max(len(p) for p in rests)
        ids = torch.zeros((len(rests), width), dtype=torch.long)
        mask = torch.zeros((len(rests), width), dtype=torch.long)
        for row, rest in enumerate(rests):
            ids[row, width - len(rest) :] = torch.tensor(rest)
            mask[row, width - len(rest) :] = 1
        # Each row's positions go on from its cached prefix.
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0) + torch.tensor(cached).unsqueeze(1)
        self.prefill_tokens += sum(len(rest) for rest in rests)
        return PrefillGroup(items, ids, mask, positions, kv, cached)

    def _shares_uncached_start(self, item: Submitted, uncached: set[bytes]) -> bool:
        """Whether `item`'s prompt starts with at least DEFER_SHARED_TOKENS that this group
        prefills already and the cache does not hold yet: then it waits for the next group,
        which reads them from the cache instead of prefilling them again (16 requests sending
        one long system prompt at once prefill it once). Otherwise its uncached blocks join
        `uncached`."""
        cache = self.prefix_cache
        if cache is None:
            return False
        digests = self._digests(item)
        shared = 0
        for digest in digests:
            if digest in uncached:
                shared += 1
            elif digest not in cache.blocks:
                break
        if shared * cache.block_size >= DEFER_SHARED_TOKENS:
            return True
        uncached.update(d for d in digests if d not in cache.blocks)
        return False

    def _cached_prefixes(self, items: list[Submitted], kv: BatchKV) -> list[int]:
        """Fill `kv` with the cached keys/values of each prompt's longest cached prefix
        (right-aligned, zeros and mask 0 on the left) and return their lengths. The rest of a
        prompt is prefilled after them: the columns between a short row's prefix and its rest
        are masked padding, and its position ids go on from its prefix. At least a prompt's
        last token is always prefilled: its logits give the first sample."""
        cache = self.prefix_cache
        if cache is None:
            return [0] * len(items)
        # A prompt's last token is never read from the cache: its logits give the first sample.
        found = [
            cache.lookup(self._digests(i)[: (len(i.request.prompt_ids) - 1) // cache.block_size])
            for i in items
        ]
        cached = [len(blocks) * cache.block_size for blocks in found]
        longest = max(cached)
        if longest == 0:
            return cached
        cache.hit_tokens += sum(cached)
        kv.mask = torch.zeros((len(items), longest), dtype=torch.long, device=self.device)
        prefixes = []  # per row: (keys, values) per layer, or None
        for row, (blocks, length) in enumerate(zip(found, cached, strict=True)):
            kv.mask[row, longest - length :] = 1
            prefixes.append(prefix_tensors(blocks, length) if length else None)
        for layer_index, layer in enumerate(kv.layers()):
            keys, values = _right_aligned(prefixes, layer_index, longest)
            layer.replace(keys.to(self.device), values.to(self.device))
        return cached

    def _prefill_chunk(self) -> None:
        group = self.group
        rows, width = group.ids.shape
        columns = max(1, self.prefill_chunk_tokens // rows)
        end = min(width, group.done + columns)
        span = slice(group.done, end)
        adapters = [item.request.adapter for item in group.items]
        logits = self._forward(
            group.ids[:, span], group.mask[:, span], group.positions[:, span], group.kv, adapters
        )
        group.done = end
        if end < width:
            return
        self._start_sequences(group, logits[:, -1])

    def _start_sequences(self, group: PrefillGroup, logits: torch.Tensor) -> None:
        """Sample each sample's first token from its prompt's logits; the unfinished rows
        join the running batch (a sample that cannot even start has failed alone)."""
        if self.prefix_cache is not None:
            self._store_prefixes(group)
        counts = torch.tensor([item.request.params.n for item in group.items])
        if bool((counts > 1).any()):
            group.kv.repeat_rows(counts)
            logits = logits.repeat_interleave(counts, dim=0)
        prepared = [
            self._prepared(item, index)
            for item in group.items
            for index in range(item.request.params.n)
        ]
        started = [i for i, seq in enumerate(prepared) if seq is not None]
        if started:
            self._advance([prepared[i] for i in started], logits[started])
        # Indices into `prepared`: the group's cache rows, one per sample.
        keep = [i for i in started if prepared[i].finish_reason is None]
        if keep:
            group.kv.select(torch.tensor(keep))
            self.kv.merge(group.kv)
        with self.slots:
            self.running = self.running + [prepared[i] for i in keep]
            self.group = None

    def _store_prefixes(self, group: PrefillGroup) -> None:
        """Keep the whole blocks of each prompt that the cache does not hold yet."""
        cache = self.prefix_cache
        for row, item in enumerate(group.items):
            digests = self._digests(item)
            if all(digest in cache.blocks for digest in digests):
                continue
            columns = group.kv.mask[row].nonzero().squeeze(1)  # the prompt's, in order
            layers = group.kv.layers()
            keys = [layer.keys[row][:, columns] for layer in layers]
            values = [layer.values[row][:, columns] for layer in layers]
            cache.store(digests, keys, values)

    def _digests(self, item: Submitted) -> list[bytes]:
        if item.digests is None:
            item.digests = self.prefix_cache.digests(item.request.prompt_ids, item.request.adapter)
        return item.digests

    def _prepared(self, item: Submitted, index: int) -> Sequence | None:
        """Sample `index` of `item` ready to decode, or None when preparing it failed (its
        caller has been told)."""
        try:
            return self._new_sequence(item, index)
        except Exception as exc:
            request_id = item.request.request_id
            error, error_id = _failure(exc, request_id, index)
            delta = SampleDelta(request_id, index, (), "", (), "error", error, error_id)
            _send(item.on_delta, delta)
            return None

    def _new_sequence(self, item: Submitted, index: int) -> Sequence:
        request, params = item.request, item.request.params
        seed = params.seed + index if params.seed is not None else self.seeds.getrandbits(63)
        room = self.max_model_len - len(request.prompt_ids)
        return Sequence(
            request=request,
            index=index,
            on_delta=item.on_delta,
            row=RowState(
                params,
                list(request.prompt_ids),
                _seeded(seed),
                matcher=request.constraint.matcher() if request.constraint else None,
            ),
            detokenizer=IncrementalText(self.tokenizer),
            stop_text=StopText(params.stop),
            max_new_tokens=min(params.max_tokens, room),
            # ignore_eos drops the model's end-of-turn tokens, not the ones the request names.
            stop_token_ids=frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else self.stop_token_ids),
        )

    # -- decoding ------------------------------------------------------------------------------

    def _decode(self) -> None:
        drafts = self._drafts()
        if drafts:
            self._decode_speculative(drafts)
        else:
            ids = torch.tensor([[seq.last_token] for seq in self.running])
            positions = torch.tensor([[seq.position] for seq in self.running])
            adapters = [seq.adapter for seq in self.running]
            logits = self._forward(ids, torch.ones_like(ids), positions, self.kv, adapters)
            self._advance(self.running, logits[:, -1])
        self._drop_finished()

    def _drafts(self) -> list[list[int]] | None:
        """Each running row's draft tokens, or None when this step does not speculate (off,
        a batch too large, or no row has a draft)."""
        speculation = self.speculation
        if speculation is None or len(self.running) > speculation.max_rows:
            return None
        drafts = []
        for seq in self.running:
            # The step samples one token more than the draft: stay within max_new_tokens.
            room = seq.max_new_tokens - len(seq.row.output_ids) - 1
            history = seq.row.prompt_ids + seq.row.output_ids
            ready = seq.draft_backoff.ready()
            drafts.append(speculation.propose(history, room) if ready else [])
        return drafts if any(drafts) else None

    def _decode_speculative(self, drafts: list[list[int]]) -> None:
        """One forward over each row's last token and its draft (right-padded, masked), then
        per position the rows still agreeing sample their next token from that position's
        logits, as a plain step would; a row stops at its first token that differs from its
        draft (that token is its next input, like any sampled token)."""
        running = self.running
        width = 1 + max(len(draft) for draft in drafts)
        ids = torch.zeros((len(running), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (seq, draft) in enumerate(zip(running, drafts, strict=True)):
            ids[row, : 1 + len(draft)] = torch.tensor([seq.last_token, *draft])
            mask[row, : 1 + len(draft)] = 1
        start = torch.tensor([seq.position for seq in running]).unsqueeze(1)
        last = start + torch.tensor([len(draft) for draft in drafts]).unsqueeze(1)
        # A row's padding columns repeat its last position: past it a position could leave
        # the range of a model with learned position embeddings near the context's end.
        positions = torch.minimum(start + torch.arange(width), last)
        adapters = [seq.adapter for seq in running]
        logits = self._forward(ids, mask, positions, self.kv, adapters, keep=width)
        kept = self._verify(drafts, logits)
        self.kv.keep_new_columns(width, kept)
        for seq, draft, columns in zip(running, drafts, kept, strict=True):
            if draft:
                seq.draft_backoff.record(accepted=columns - 1)

    def _verify(self, drafts: list[list[int]], logits: torch.Tensor) -> list[int]:
        """Sample the running rows position by position from a speculative forward's
        `logits` [rows, columns, vocab] while each agrees with its draft; per row, how many
        of the new columns hold its accepted tokens (its last token and the draft tokens
        sampling agreed with)."""
        running = self.running
        # Counted before each row's last delta goes out: a caller that reads the stats when
        # its answer is done sees its own drafts counted.
        counters = self.speculated
        counters.steps += 1
        counters.draft_tokens += sum(len(draft) for draft in drafts)
        kept = [1] * len(running)
        agreeing = list(range(len(running)))
        for column in range(logits.shape[1]):
            self._advance([running[r] for r in agreeing], logits[agreeing, column])
            agreeing = [
                r
                for r in agreeing
                if running[r].finish_reason is None
                and column < len(drafts[r])
                and running[r].last_token == drafts[r][column]
            ]
            for r in agreeing:
                kept[r] = column + 2  # its last token and the draft up to this one
            counters.accepted_tokens += len(agreeing)
            if not agreeing:
                break
        return kept

    def _advance(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence and send each its delta; a sequence whose sampling or
        detokenizing raises fails alone."""
        picks = sample_each(logits, [seq.row for seq in sequences])
        for seq, pick in zip(sequences, picks, strict=True):
            if isinstance(pick, Exception):
                self._fail(seq, pick)
                continue
            try:
                delta = seq.accept(*pick)
            except Exception as exc:
                self._fail(seq, exc)
                continue
            self._emit(seq, delta)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        error, error_id = _failure(exc, seq.request_id, seq.index)
        self._emit(seq, seq.fail(error, error_id))

    def _emit(self, seq: Sequence, delta: SampleDelta) -> None:
        if not _send(seq.on_delta, delta) and seq.finish_reason is None:
            # A caller whose callback fails is gone: stop spending compute on it.
            seq.finish_reason = "abort"

    def _drop_finished(self) -> None:
        keep = [i for i, seq in enumerate(self.running) if seq.finish_reason is None]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if keep:
            self.kv.select(torch.tensor(keep))
        else:
            self.kv = BatchKV(self.num_layers, 0, self.device)

    def _forward(self, ids, new_mask, positions, kv: BatchKV, adapters, keep=1) -> torch.Tensor:
        """Logits of each row's last `keep` columns, [rows, keep, vocab], float32 on the CPU;
        `kv` grows by the columns."""
        mask = kv.extend_mask(new_mask.to(self.device))
        attention = mask
        if self.window_masks is not None:
            attention = self.window_masks(mask, ids.shape[1], kv.cache, self.dtype)
        extra = {CACHE_KEYWORD: kv.cache}
        if self.adapters:
            extra["adapter_names"] = [a or BASE_ADAPTER for a in adapters]
        output = self.model(
            input_ids=ids.to(self.device),
            attention_mask=attention,
            position_ids=positions.to(self.device),
            use_cache=True,
            logits_to_keep=keep,
            **extra,
        )
        return output.logits.float().cpu()


def _right_aligned(prefixes: list, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's [rows, heads, length, head_dim] keys and values: each row's cached prefix
    (None: none) on the right, zeros on the left."""
    keys_like, values_like = next((p[0][layer], p[1][layer]) for p in prefixes if p is not None)
    rows = len(prefixes)
    keys = keys_like.new_zeros((rows, keys_like.shape[0], length, keys_like.shape[-1]))
    values = values_like.new_zeros((rows, values_like.shape[0], length, values_like.shape[-1]))
    for row, prefix in enumerate(prefixes):
        if prefix is not None:
            n = prefix[0][layer].shape[1]
            keys[row, :, length - n :] = prefix[0][layer]
            values[row, :, length - n :] = prefix[1][layer]
    return keys, values


def _seeded(seed: int) -> torch.Generator:
    """The sample's generator; a seed no generator takes is the request's mistake (the engine
    checks seeds at submit: this holds for callers that build a scheduler themselves)."""
    try:
        return make_generator(seed)
    except (OverflowError, ValueError, RuntimeError) as exc:
        raise InvalidRequest(
            f"seed {seed}: cannot seed a random generator with it ({exc}); give a 64-bit "
            "integer, in [-2**63, 2**63)"
        ) from None


def _failure(exc: Exception, request_id: str, index: int) -> tuple[str, str | None]:
    """(error, error_id) of sample `index` failing with `exc`: the request's own mistake
    (`InvalidRequest`, no id: the caller can fix it), or the engine's, logged with its
    traceback under a new id that the caller's error names."""
    if isinstance(exc, InvalidRequest):
        log.warning("request %s, sample %d refused: %s", request_id, index, exc)
        return str(exc), None
    error_id = new_error_id()
    log.error(
        "request %s, sample %d failed (error id %s); the rest of the batch goes on",
        request_id,
        index,
        error_id,
        exc_info=exc,
    )
    return f"{type(exc).__name__}: {exc}", error_id


def _abort_submitted(item: Submitted, error: str | None, error_id: str | None = None) -> None:
    """End every sample of a request that has no sequence yet."""
    request_id = item.request.request_id
    for index in range(item.request.params.n):
        delta = SampleDelta(request_id, index, (), "", (), "abort", error, error_id)
        _send(item.on_delta, delta)


def _send(on_delta: Callable[[SampleDelta], None], delta: SampleDelta) -> bool:
    """Deliver a delta; a failing callback is logged, never allowed to stop the loop."""
    try:
        on_delta(delta)
        return True
    except Exception:
        log.exception("a delta callback failed for request %s", delta.request_id)
        return False
