"""`swiftlm rlhf --rlhf_type kto`: Kahneman-Tversky Optimization on unpaired answers.

Rows (data/unpaired.py) are single answers labelled desirable or undesirable; a preference
pair becomes one of each. An encoded sample keeps its prompt and its answer apart, so that a
micro-batch can pair any answer with any prompt. The reference is DPO's (methods/reference.py:
the base with the LoRA adapter disabled, a frozen copy with full fine-tuning, or --ref_model).

Loss of sample i (losses.preference.kto_losses), u_i = log pi(y_i|x_i) - log pi_ref(y_i|x_i):
  kto:               desirable w_d (1 - sigma(beta (u_i - z))), undesirable w_u (1 - sigma(beta (z - u_i)))
  apo_zero_unpaired: desirable w_d (1 - sigma(beta u_i)),       undesirable w_u sigma(beta u_i)
summed over the samples; the loop divides by the step's number of samples (the normalizer), as
TRL's `losses.nanmean()` does.

The reference point z (kto only) is TRL's KL estimate. Each micro-batch of B rows also holds B
mismatched rows: the answer of row i after the prompt of row i+1 (cyclically), x_{i+1} + y_i.
Then z = max(0, mean_i [log pi(y_i|x_{i+1}) - log pi_ref(y_i|x_{i+1})]), computed without
gradient (TRL runs those forwards under no_grad and detaches z), averaged over the rows of the
micro-batch that are real samples (weight 1). z is therefore a PER-MICRO-BATCH, per-rank
estimate, as in TRL (TRL also averages it over ranks): it is not a sum the loop can normalize,
so splitting a step differently (4 micro-batches of 1 vs 1 of 4) gives other mismatched pairs
and another z, and the gradients differ. Everything else is exact under accumulation: with
--loss_type apo_zero_unpaired (no z) 4 x 1 equals 1 x 4. With one row a micro-batch would pair
the answer with its own prompt (z = its own reward), so --per_device_train_batch_size 1 is
refused for kto, as TRL does; a short last micro-batch of one row (or an evaluation batch
of one, --per_device_eval_batch_size 1) still has that z.

Logged (sums over the micro-batch's samples; the loop divides them by the step's samples):
loss; rewards/chosen and logps/chosen summed over the desirable samples, rewards/rejected and
logps/rejected over the undesirable ones, with rewards = beta u; count/chosen and
count/rejected, the desirable and undesirable shares of the step's samples; kl, z weighted by
the micro-batch's samples (so the logged kl is the sample-weighted mean of the micro-batches'
z). The mean over the desirable samples that TRL logs as rewards/chosen is
rewards/chosen / count/chosen (likewise for the other three): the loop divides every metric
by one normalizer, the step's samples over all micro-batches and ranks, so a sum over the
desirable subset cannot come out as a mean over that subset.

--precompute_ref_log_probs: every answer's reference log-prob log pi_ref(y_i|x_i) is computed
once before training (methods/preference/precomputed.py) and read by the steps. The
mismatched rows' reference log-probs are not: their pairs are drawn per micro-batch, so
with --loss_type kto the reference still runs on them each step (half the reference work
of a step without the flag); with apo_zero_unpaired no step runs the reference.
"""

import contextlib

import torch

from swiftlm.config import RLHFConfig
from swiftlm.data.collate import collate
from swiftlm.data.encode import IGNORE_INDEX, TruncationReport, encode_chat, truncate
from swiftlm.data.unpaired import unpaired_samples
from swiftlm.errors import ConfigError, DataError
from swiftlm.losses.preference import kto_losses
from swiftlm.methods.base import Batch, EncodeResult, Layout, LossOutput, MethodDefaults
from swiftlm.methods.preference.dpo import answer_logps, packed_answers
from swiftlm.methods.preference.precomputed import precompute_splits
from swiftlm.methods.reference import Reference
from swiftlm.methods.token import token_pads

MAIN, KL = "", "kl_"  # the prefixes of the matched and the mismatched rows' tensors
REF_LOGPS = "ref_logps"  # a sample's precomputed reference log-prob (--precompute_ref_log_probs)


class KTO(MethodDefaults):
    name = "kto"
    columns = ("prompt_ids", "completion_ids", "completion_labels", "desirable", "weight")
    # --padding_free/--packing: matched rows share packed rows, mismatched ones too.
    supports_packing = True
    default_datasets: tuple[str, ...] = ()
    # Sequence parallel: answers' whole log-probs are summed over the group's shards
    # (answer_logps); the group's first shard alone weighs the sample.
    sequence_owned = ("weight",)

    def __init__(self, cfg: RLHFConfig, tokenizer):
        self.tokenizer = tokenizer
        self.token_pads = {**token_pads(tokenizer.pad_token_id), "answer_ids": -1}
        self.data, self.rlhf = cfg.data, cfg.rlhf
        self.uses_kl = cfg.rlhf.loss_type == "kto"
        self.sequence_row_sets = (MAIN, KL) if self.uses_kl else (MAIN,)
        self.reference = Reference(cfg, self.name)
        self.eval_batch_size = cfg.train.per_device_eval_batch_size
        self.torch_dtype = cfg.model.torch_dtype
        if self.uses_kl and cfg.train.per_device_train_batch_size == 1:
            raise ConfigError(
                "--per_device_train_batch_size 1: KTO's KL estimate pairs each answer with the "
                "prompt of another row of its micro-batch, and a micro-batch of one row has "
                "none. Use 2 or more (with fewer --gradient_accumulation_steps), or "
                "--loss_type apo_zero_unpaired (no KL term)"
            )

    # -- data ----------------------------------------------------------------------------------

    def to_sample(self, record: dict) -> dict:
        return unpaired_samples(
            record, method="swiftlm rlhf --rlhf_type kto", system=self.data.system
        )

    def encode(self, samples: list[dict]) -> EncodeResult:
        """Each answer's prompt ids, answer ids and labels (the loss is on the last turn);
        over-long ones follow --truncation_strategy, and one left without label tokens is
        dropped."""
        d = self.data
        report = TruncationReport(d.truncation_strategy, d.max_length)
        encoded = []
        for sample in samples:
            for answer in sample["answers"]:
                tokens = encode_chat(self.tokenizer, answer["messages"], "last_turn")
                tokens = truncate(tokens, d.max_length, d.truncation_strategy, report)
                if tokens is not None:
                    encoded.append(_split(tokens, answer["desirable"]))
        if not encoded:
            raise DataError(
                f"no KTO answer fits --max_length {d.max_length} with --truncation_strategy "
                f"{d.truncation_strategy} ({report}); raise --max_length"
            )
        desirable = sum(s["desirable"] for s in encoded)
        log = [f"kto: {desirable} desirable and {len(encoded) - desirable} undesirable answers"]
        log += [report.summary()] if report.summary() else []
        return EncodeResult(encoded, log, report.as_dict())

    def cache_options(self) -> dict:
        d = self.data
        return {
            "method": self.name,
            "max_length": d.max_length,
            "truncation_strategy": d.truncation_strategy,
            "system": d.system,
        }

    def length(self, sample: dict) -> int:
        """The matched row, plus about as much again for the mismatched (KL) row."""
        tokens = len(sample["prompt_ids"]) + len(sample["completion_ids"])
        return 2 * tokens if self.uses_kl else tokens

    @staticmethod
    def masked(sample: dict) -> dict:
        return {**sample, "weight": 0.0}

    def collate(self, layout: Layout) -> Batch:
        """B right-padded rows x_i + y_i; with kto also the B mismatched rows x_{i+1} + y_i
        (`kl_*` tensors); `desirable` and `weight` [B] (weight 0 for padding samples).
        Packed (--padding_free, --packing): the matched rows share packed rows, and so do the
        mismatched ones, each answer numbered as in the padded layout (`packed_answers`)."""
        samples = [sample for row in layout.rows for sample in row]
        n, limit = len(samples), self.data.max_length
        matched = [_row(s, s, None) for s in samples]
        batch = self._layout(matched, layout)
        if self.uses_kl:
            mismatched = [_row(samples[(i + 1) % n], samples[i], limit) for i in range(n)]
            batch |= {KL + k: v for k, v in self._layout(mismatched, layout).items()}
        batch["desirable"] = torch.tensor([bool(s["desirable"]) for s in samples])
        batch["weight"] = torch.tensor([s["weight"] for s in samples], dtype=torch.float32)
        if REF_LOGPS in samples[0]:  # --precompute_ref_log_probs
            batch[REF_LOGPS] = torch.tensor([s[REF_LOGPS] for s in samples], dtype=torch.float32)
        return batch

    def _layout(self, rows: list[dict], layout: Layout) -> Batch:
        """`rows` (one per sample, in order) padded, or packed as the layout's rows are."""
        pad = self.tokenizer.pad_token_id
        if not layout.packed:
            return collate(rows, pad)
        numbered, first = [], 0
        for row in layout.rows:
            numbered.append([(first + i, rows[first + i]) for i in range(len(row))])
            first += len(row)
        return packed_answers(numbered, pad)

    @staticmethod
    def normalizer(batch: Batch) -> torch.Tensor:
        """Samples (padding samples of an idle data-parallel rank weigh 0)."""
        return batch["weight"].sum()

    # -- model and loss --------------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module, log) -> None:
        r = self.rlhf
        log(
            f"kto: beta {r.beta}, loss_type {r.loss_type}, desirable_weight {r.desirable_weight}, "
            f"undesirable_weight {r.undesirable_weight}"
        )
        if r.precompute_ref_log_probs and not self.uses_kl and not r.ref_model:
            return  # no step runs the reference: the initial policy scores in prepare_samples
        self.reference.prepare(model, log)

    def prepare_samples(self, model: torch.nn.Module, train, val, log) -> tuple:
        """--precompute_ref_log_probs: every answer's reference log-prob, computed once now and
        kept with the samples; the reference is freed unless the KL rows still need it."""
        if not self.rlhf.precompute_ref_log_probs:
            return train, val
        train, val = precompute_splits(
            model, train, val, self.eval_batch_size, self.torch_dtype, self._score
        )
        kept = "kept for the KL rows" if self.uses_kl else "freed"
        if not self.uses_kl:
            self.reference.free()
        log(
            f"kto: reference log-probs of {len(train) + len(val)} answers precomputed; the "
            f"reference model is {kept}"
        )
        return train, val

    def _score(self, model, samples: list[dict], device) -> dict[str, list[float]]:
        """The reference log-prob of each sample's answer after its own prompt."""
        rows = [_row(s, s, None) for s in samples]
        batch = self._layout(rows, Layout(rows=[[s] for s in samples], packed=False))
        batch = {k: v.to(device) for k, v in batch.items()}
        if self.reference.model is None and not self.reference.uses_lora:
            reference, context = model, contextlib.nullcontext()  # the initial policy itself
        else:
            reference, context = self.reference.module(model)
        logps, _ = answer_logps(reference, _rows(batch, MAIN), context, len(samples))
        return {REF_LOGPS: logps.tolist()}

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        weight = batch["weight"]
        kl = self._kl(model, batch) if self.uses_kl else torch.zeros((), device=weight.device)
        logps, _ = answer_logps(model, _rows(batch, MAIN), answers=weight.numel())
        if REF_LOGPS in batch:
            ref_logps = batch[REF_LOGPS].to(logps)
        else:
            ref_logps = self._reference_logps(model, batch, MAIN)
        desirable = batch["desirable"].bool()
        r = self.rlhf
        losses = kto_losses(
            logps, ref_logps, kl, desirable,
            beta=r.beta, desirable_weight=r.desirable_weight,
            undesirable_weight=r.undesirable_weight, loss_type=r.loss_type,
        )  # fmt: skip
        rewards = (r.beta * (logps - ref_logps)).detach()
        chosen = desirable.to(weight) * weight
        rejected = (~desirable).to(weight) * weight
        metrics = {
            "rewards/chosen": (rewards * chosen).sum(),
            "rewards/rejected": (rewards * rejected).sum(),
            "logps/chosen": (logps.detach() * chosen).sum(),
            "logps/rejected": (logps.detach() * rejected).sum(),
            "count/chosen": chosen.sum(),
            "count/rejected": rejected.sum(),
            "kl": kl * weight.sum(),
        }
        return (losses * weight).sum(), metrics

    def _reference_logps(self, model, batch: Batch, prefix: str) -> torch.Tensor:
        reference, context = self.reference.module(model)  # a fresh context per forward
        with torch.no_grad():
            answers = batch["weight"].numel()
            return answer_logps(reference, _rows(batch, prefix), context, answers)[0]

    def _kl(self, model, batch: Batch) -> torch.Tensor:
        """z = max(0, weighted mean of the mismatched rows' policy - reference log-probs)."""
        with torch.no_grad():
            policy, _ = answer_logps(model, _rows(batch, KL), answers=batch["weight"].numel())
        gaps = policy - self._reference_logps(model, batch, KL)
        weight = batch["weight"].to(gaps)
        mean = (gaps * weight).sum() / weight.sum().clamp(min=1e-12)
        return mean.clamp(min=0).detach()

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, batch: Batch) -> LossOutput:
        raise ConfigError(
            "--pipeline_parallel_size: swiftlm rlhf (KTO) has no pipeline-parallel form; use "
            "data parallel, FSDP2 or DeepSpeed"
        )


def _split(tokens: dict, desirable: bool) -> dict:
    """An encoded conversation -> its prompt (every token before the first label) and answer."""
    ids, labels = tokens["input_ids"], tokens["labels"]
    start = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    return {
        "prompt_ids": ids[:start],
        "completion_ids": ids[start:],
        "completion_labels": labels[start:],
        "desirable": int(desirable),
        "weight": 1.0,
    }


def _row(prompt_of: dict, answer_of: dict, limit: int | None) -> dict:
    """The prompt of one sample followed by the answer of another (the same for matched rows),
    cut to `limit` tokens (a mismatched row may be longer than either sample)."""
    prompt = list(prompt_of["prompt_ids"])
    ids = prompt + list(answer_of["completion_ids"])
    labels = [IGNORE_INDEX] * len(prompt) + list(answer_of["completion_labels"])
    if limit is not None:
        ids, labels = ids[:limit], labels[:limit]
    return {"input_ids": ids, "labels": labels}


ROW_KEYS = ("input_ids", "attention_mask", "position_ids", "labels", "answer_ids")


def _rows(batch: Batch, prefix: str) -> Batch:
    """The matched (MAIN) or mismatched (KL) rows' tensors, in either layout."""
    return {k: batch[prefix + k] for k in ROW_KEYS if prefix + k in batch}
