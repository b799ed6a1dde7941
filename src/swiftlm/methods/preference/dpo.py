"""`swiftlm rlhf --rlhf_type dpo`: Direct Preference Optimization and its loss variants.

Rows are preference pairs (data/preference.py). A micro-batch holds B pairs as 2B rows, the
chosen conversations first, and one forward pass of the policy gives the log-prob of each
answer (summed over its label tokens, the last assistant turn). The reference's log-probs
come from the same weights with the LoRA adapter switched off (no second copy of the model)
or, with full fine-tuning, from a frozen copy taken before training. The loss of each pair is
a pure function of the four log-probs (losses/preference.py); the loop normalizes by the
number of pairs in the optimizer step, so gradient accumulation is exact.

Logged per pair: loss, rewards/chosen = beta (c - c0), rewards/rejected, rewards/margins,
rewards/accuracies (chosen reward above rejected), logps/chosen, logps/rejected, and nll
(mean token NLL of the chosen answers), which --rpo_alpha adds to the loss.

Options (TRL's DPOConfig names):
- several --loss_type with --loss_weights: the per-pair loss is sum_k w_k loss_k;
- bco_pair: its reward shift delta is a running mean (losses.preference.RunningMean) of the
  training micro-batches' mean rewards, one value per micro-batch, as TRL <= 0.21 kept it.
  delta therefore depends on the sequence of micro-batches this process has seen: the split
  of a step into micro-batches (4 x 1 and 1 x 4 give other deltas), the data-parallel rank
  (each rank keeps its own mean; TRL averaged the ranks' means), and the run's history: it
  is not in the checkpoint, so a resumed run starts it again at the resumed step. Evaluation
  reads it without updating it. With one micro-batch per step on one process, delta is TRL's;
- --ref_model: the reference is that model (methods/reference.py);
- --precompute_ref_log_probs: `prepare_samples` scores every pair with the reference once,
  before training, and returns the samples with `ref_chosen_logps`/`ref_rejected_logps`
  attached (methods/preference/precomputed.py); the reference is then freed and no step
  runs it.
"""

import contextlib

import torch

from swiftlm.config import RLHFConfig
from swiftlm.data.collate import collate, collate_packed, model_inputs
from swiftlm.data.encode import IGNORE_INDEX, TruncationReport, encode_chat, truncate
from swiftlm.data.preference import preference_sample
from swiftlm.data.vision_batch import VISION_COLUMN
from swiftlm.data.vision_encode import ImageThroughput, encode_vision_chat, truncate_vision
from swiftlm.data.vision_rows import local_image_files, vision_preference_sample
from swiftlm.errors import DataError
from swiftlm.losses.causal_lm import shifted_labels, token_cross_entropy
from swiftlm.losses.preference import (
    RunningMean,
    bco_batch_reward,
    dpo_rewards,
    weighted_dpo_losses,
)
from swiftlm.methods.base import Batch, EncodeResult, Layout, LossOutput, MethodDefaults
from swiftlm.methods.preference.precomputed import precompute_splits
from swiftlm.methods.reference import Reference, unwrapped
from swiftlm.methods.token import token_pads
from swiftlm.methods.vision import VisionInputs
from swiftlm.models.sequence_group import sum_over_shards

__all__ = ["DPO", "answer_logps", "pair_metrics", "unwrapped", "weighted_sums"]

SIDES = ("chosen", "rejected")


class DPO(MethodDefaults):
    name = "dpo"
    columns = (
        "chosen_input_ids",
        "chosen_labels",
        "rejected_input_ids",
        "rejected_labels",
        "weight",
    )
    # --padding_free/--packing: the answers of a micro-batch's pairs share rows, positions
    # restarting per answer; each answer's log-prob is summed over its segment.
    supports_packing = True
    default_datasets: tuple[str, ...] = ()
    # A vision-language model: each side keeps its image features (methods.vision), one
    # conversation per row.
    supports_images = True
    packs_images = False
    # Sequence parallel: a pair's loss needs its answers' whole log-probs, summed over the
    # group's shards (answer_logps); the group's first shard alone weighs the pair.
    sequence_owned = ("weight",)

    def __init__(self, cfg: RLHFConfig, tokenizer, vision: VisionInputs | None = None):
        self.tokenizer = tokenizer
        self.vision = vision
        if vision is not None:
            self.columns = (*self.columns, *(f"{side}_{VISION_COLUMN}" for side in SIDES))
        self.token_pads = {**token_pads(tokenizer.pad_token_id), "answer_ids": -1}
        self.data, self.rlhf = cfg.data, cfg.rlhf
        self.uses_lora = cfg.tuner.train_type != "full"
        self.ref = Reference(cfg, self.name)
        self.resuming = bool(cfg.output.resume_from_checkpoint)
        self.eval_batch_size = cfg.train.per_device_eval_batch_size
        self.torch_dtype = cfg.model.torch_dtype
        self.bco_mean = RunningMean()  # bco_pair's reward shift

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference model; None for LoRA (the adapter disabled) or once freed."""
        return self.ref.model

    # -- data ----------------------------------------------------------------------------------

    def to_sample(self, record: dict) -> dict:
        options = dict(method="swiftlm rlhf", system=self.data.system)
        if self.vision is not None:
            return vision_preference_sample(record, **options)
        return preference_sample(record, **options)

    def encode(self, samples: list[dict]) -> EncodeResult:
        """Each side's ids and labels (loss on its last answer); over-long pairs follow
        --truncation_strategy, and a pair with a side left without label tokens is dropped."""
        d = self.data
        report = TruncationReport(d.truncation_strategy, d.max_length)
        throughput = ImageThroughput()
        encoded = []
        for sample in samples:
            try:
                sides = [self._encode_side(sample[side], report, throughput) for side in SIDES]
            except DataError as exc:
                raise DataError(f"{sample.get('source', 'sample')}: {exc}") from None
            if None not in sides:
                encoded.append(self.pair_sample(sample, *sides))
        if not encoded:
            raise DataError(
                f"no preference pair fits --max_length {d.max_length} with "
                f"--truncation_strategy {d.truncation_strategy} ({report}); raise --max_length"
            )
        if self.vision is None:
            lines = [report.summary()] if report.summary() else []
            return EncodeResult(encoded, lines, report.as_dict())
        lines = self.vision.lines(report, throughput)
        return EncodeResult(encoded, lines, report.as_dict(), local_image_files(samples))

    def _encode_side(self, messages, report, throughput) -> dict | None:
        """One side's ids and labels (and image features), truncated; None: dropped."""
        d = self.data
        if self.vision is None:
            encoded = encode_chat(self.tokenizer, messages, "last_turn")
            return truncate(encoded, d.max_length, d.truncation_strategy, report)
        v = self.vision
        encoded = encode_vision_chat(
            v.processor, messages, "last_turn", v.image_ids, throughput, None, v.max_pixels
        )
        return truncate_vision(encoded, d.max_length, d.truncation_strategy, report, v.image_ids)

    def pair_sample(self, sample: dict, chosen: dict, rejected: dict) -> dict:
        """The encoded pair: both sides' ids and labels (and image features), weight 1
        (methods add columns)."""
        pair = _pair(chosen, rejected)
        if self.vision is not None:
            for side, encoded in zip(SIDES, (chosen, rejected), strict=True):
                pair[f"{side}_{VISION_COLUMN}"] = encoded[VISION_COLUMN]
        return pair

    def cache_options(self) -> dict:
        d = self.data
        return {
            "method": self.name,
            "max_length": d.max_length,
            "truncation_strategy": d.truncation_strategy,
            "system": d.system,
            **(self.vision.cache_options() if self.vision is not None else {}),
        }

    @staticmethod
    def length(sample: dict) -> int:
        return len(sample["chosen_input_ids"]) + len(sample["rejected_input_ids"])

    @staticmethod
    def masked(sample: dict) -> dict:
        return {**sample, "weight": 0.0}

    def collate(self, layout: Layout) -> Batch:
        """2B right-padded rows, the B chosen answers first; `weight` [B] (0 for padding);
        `ref_logps` [2B] when the samples carry precomputed reference log-probs. Packed
        (--padding_free, --packing): each layout row's pairs, both sides, in one row
        (`packed_pairs`), the answers numbered as the padded rows would be."""
        if layout.packed:
            pairs = [pair for row in layout.rows for pair in row]
            batch = packed_pairs(layout.rows, self.tokenizer.pad_token_id)
        else:
            pairs = [row[0] for row in layout.rows]
            batch = self._padded(pairs)
        batch["weight"] = torch.tensor([p["weight"] for p in pairs], dtype=torch.float32)
        if REF_KEYS[0] in pairs[0]:
            values = [p[f"ref_{side}_logps"] for side in SIDES for p in pairs]
            batch["ref_logps"] = torch.tensor(values, dtype=torch.float32)
        return batch

    def _padded(self, pairs: list[dict]) -> Batch:
        rows = [
            {
                "input_ids": p[f"{side}_input_ids"],
                "labels": p[f"{side}_labels"],
                VISION_COLUMN: p.get(f"{side}_{VISION_COLUMN}", b""),
            }
            for side in SIDES
            for p in pairs
        ]
        batch = collate(rows, self.tokenizer.pad_token_id)
        if self.vision is not None:
            width = batch["input_ids"].shape[1]
            batch.update(self.vision.batch_inputs([[row] for row in rows], width))
        return batch

    @staticmethod
    def normalizer(batch: Batch) -> torch.Tensor:
        """Pairs (padding pairs of an idle data-parallel rank weigh 0)."""
        return batch["weight"].sum()

    # -- model and loss --------------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module, log) -> None:
        r = self.rlhf
        weights = f", loss_weights {r.loss_weights}" if r.loss_weights else ""
        log(
            f"dpo: beta {r.beta}, loss_type {r.loss_type}{weights}, label_smoothing "
            f"{r.label_smoothing}, rpo_alpha {r.rpo_alpha}"
        )
        if "bco_pair" in r.loss_types() and self.resuming:
            log(
                "dpo: bco_pair's running reward mean is not kept in checkpoints; a resumed run "
                "starts it again"
            )
        if r.precompute_ref_log_probs and not r.ref_model:
            return  # the reference is the initial policy itself: scored in prepare_samples
        self.ref.prepare(model, log)

    def prepare_samples(self, model: torch.nn.Module, train, val, log) -> tuple:
        """--precompute_ref_log_probs: every pair's reference log-probs, computed once now
        (methods/preference/precomputed.py), kept with the samples; the reference is freed."""
        if not self.rlhf.precompute_ref_log_probs:
            return train, val
        train, val = precompute_splits(
            model, train, val, self.eval_batch_size, self.torch_dtype, self._score
        )
        self.ref.free()
        log(
            f"dpo: reference log-probs of {len(train) + len(val)} pairs precomputed; "
            "the reference model is freed"
        )
        return train, val

    def _score(self, model, pairs: list[dict], device) -> dict[str, list[float]]:
        """The reference log-probs of `pairs`' chosen and rejected answers."""
        batch = self.collate(Layout(rows=[[pair] for pair in pairs], packed=False))
        batch = {k: v.to(device) for k, v in batch.items()}
        if self.ref.model is None and not self.uses_lora:  # the initial policy itself
            reference, context = model, contextlib.nullcontext()
        else:
            reference, context = self._reference(model)
        logps, _ = answer_logps(reference, batch, context)
        count = len(pairs)
        return {REF_KEYS[0]: logps[:count].tolist(), REF_KEYS[1]: logps[count:].tolist()}

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        logps, counts = answer_logps(model, batch)
        if "ref_logps" in batch:
            ref_logps = batch["ref_logps"].to(logps)
        else:
            reference, context = self._reference(model)
            with torch.no_grad():
                ref_logps, _ = answer_logps(reference, batch, context)
        pairs = logps.shape[0] // 2
        chosen, rejected = logps[:pairs], logps[pairs:]
        ref_chosen, ref_rejected = ref_logps[:pairs], ref_logps[pairs:]
        r = self.rlhf
        sides = (chosen, rejected, ref_chosen, ref_rejected)
        losses = weighted_dpo_losses(
            *sides, loss_types=r.loss_types(), loss_weights=r.loss_weights, beta=r.beta,
            label_smoothing=r.label_smoothing, bco_shift=self._bco_shift(model, sides, batch),
        )  # fmt: skip
        nll = -chosen / counts[:pairs]
        if r.rpo_alpha:
            losses = losses + r.rpo_alpha * nll
        rewards = (
            dpo_rewards(chosen, ref_chosen, r.beta),
            dpo_rewards(rejected, ref_rejected, r.beta),
        )
        return weighted_sums(losses, pair_metrics(chosen, rejected, *rewards, nll), batch)

    def _bco_shift(self, model, sides, batch: Batch) -> float:
        """bco_pair's delta: the running mean, first updated with this micro-batch's mean reward
        when training (TRL's order); 0 without bco_pair."""
        if "bco_pair" not in self.rlhf.loss_types():
            return 0.0
        weight = batch["weight"]
        if not model.training or float(weight.sum()) == 0:  # evaluation, an idle rank's padding
            return self.bco_mean.mean
        reward = bco_batch_reward(
            *(side.detach() for side in sides), beta=self.rlhf.beta, weight=weight
        )
        return self.bco_mean.update(float(reward))

    def _reference(self, model):
        """(the module to run, its context): the frozen model, or the policy without adapter."""
        if self.ref.model is None and not self.uses_lora:
            raise RuntimeError("dpo: the reference was freed; the batch lacks its log-probs")
        return self.ref.module(model)

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, batch: Batch) -> LossOutput:
        from swiftlm.errors import ConfigError

        raise ConfigError(
            "--pipeline_parallel_size: swiftlm rlhf (DPO) has no pipeline-parallel form; use "
            "data parallel, FSDP2 or DeepSpeed"
        )


def packed_pairs(rows: list[list[dict]], pad_token_id: int) -> Batch:
    """Each row's pairs as one packed row (their chosen answers, then their rejected ones),
    numbered as the padded layout orders them: all chosen answers, then all rejected ones."""
    count = sum(len(row) for row in rows)
    numbered, first = [], 0
    for row in rows:
        numbered.append(
            [
                (offset + first + i, {k: pair[f"{side}_{k}"] for k in ("input_ids", "labels")})
                for offset, side in ((0, "chosen"), (count, "rejected"))
                for i, pair in enumerate(row)
            ]
        )
        first += len(row)
    return packed_answers(numbered, pad_token_id)


def packed_answers(rows: list[list[tuple[int, dict]]], pad_token_id: int) -> Batch:
    """Rows of numbered answers ((index, {input_ids, labels})) packed as `collate_packed`
    does, with `answer_ids`: per token, the index of the answer it belongs to (-1: padding)."""
    batch = collate_packed([[answer for _, answer in row] for row in rows], pad_token_id)
    ids = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
    for r, row in enumerate(rows):
        owners = [index for index, answer in row for _ in answer["input_ids"]]
        ids[r, : len(owners)] = torch.tensor(owners, dtype=torch.long)
    return {**batch, "answer_ids": ids}


def answer_logps(
    model, batch: Batch, context=None, answers: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer (a row, or a segment of a packed row): the sum of its label tokens'
    log-probs (float32) and their number. `answers`: how many a packed batch holds (default:
    both sides of its pairs, known from `weight`'s shape: no device sync). Under sequence
    parallel the batch is a shard of the rows and the sums are the group's (`sum_over_shards`)."""
    with context or contextlib.nullcontext():
        logits = model(**model_inputs(batch), use_cache=False).logits
    token_logps = -token_cross_entropy(logits, batch["labels"])
    labelled = shifted_labels(batch["labels"]) != IGNORE_INDEX
    if "answer_ids" not in batch:
        sums, counts = token_logps.sum(-1), labelled.sum(-1).to(token_logps)
    else:
        # Position t scores label t + 1; where that label counts, token t + 1 is in token t's
        # answer (a packed answer's first label is ignored: collate_packed drops it).
        owner = batch["answer_ids"][labelled]
        answers = answers or 2 * batch["weight"].numel()
        sums = token_logps.new_zeros(answers).index_add(0, owner, token_logps[labelled])
        counts = token_logps.new_zeros(answers).index_add(0, owner, labelled[labelled].to(sums))
    sums, counts = sum_over_shards(model, sums, counts)
    return sums, counts.clamp(min=1)


def pair_metrics(chosen, rejected, rewards_chosen, rewards_rejected, nll) -> dict:
    """What every preference method logs per pair (TRL's names)."""
    return {
        "rewards/chosen": rewards_chosen,
        "rewards/rejected": rewards_rejected,
        "rewards/margins": rewards_chosen - rewards_rejected,
        "rewards/accuracies": (rewards_chosen > rewards_rejected).float(),
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
        "nll": nll.detach(),
    }


def weighted_sums(losses: torch.Tensor, metrics: dict, batch: Batch) -> LossOutput:
    """(loss SUM, metric SUMS) over the pairs, padding pairs (weight 0) left out."""
    weight = batch["weight"].to(losses.device)
    return (losses * weight).sum(), {k: (v * weight).sum() for k, v in metrics.items()}


REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def _pair(chosen: dict, rejected: dict) -> dict:
    return {
        "chosen_input_ids": chosen["input_ids"],
        "chosen_labels": chosen["labels"],
        "rejected_input_ids": rejected["input_ids"],
        "rejected_labels": rejected["labels"],
        "weight": 1.0,
    }
