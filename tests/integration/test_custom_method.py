"""A training method defined in this file only: SFT with per-sample weights from a `weight`
column, normalized by the weighted label-token count. It trains through swiftlm's own loop,
strategies and cache with no change outside `methods/` (here: none at all), in one process and
under DDP and FSDP2 on 2 gloo ranks, with equal losses.

Run as a script (`python test_custom_method.py <swiftlm sft flags>`, also under torchrun) it
trains the method: that is how the multi-process runs get the method without a registry.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from swiftlm.config import TrainConfig
from swiftlm.data.collate import collate, collate_packed, lm_pads
from swiftlm.data.encode import IGNORE_INDEX, encode_chat_samples
from swiftlm.data.formats import RowError, chat_sample
from swiftlm.losses.causal_lm import causal_lm_loss
from swiftlm.losses.fused_ce import fused_causal_lm_loss, install_fused_lm_head
from swiftlm.methods import token
from swiftlm.methods.base import EncodeResult, Layout


class WeightedSFT:
    """SFT where every sample's tokens count `weight` times: loss = sum_i w_i * CE_i / sum_i
    w_i * n_i over the label tokens of a step."""

    name = "weighted_sft"
    columns = ("input_ids", "labels", "token_weight")
    supports_packing = True
    default_datasets = ()

    def __init__(self, cfg: TrainConfig, tokenizer):
        self.data, self.tokenizer = cfg.data, tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.token_pads = {**token.token_pads(self.pad_id), "token_weight": 0.0}
        self.collate_pads = {**lm_pads(self.pad_id), "token_weight": 0.0}
        self.fused = cfg.train.fused_cross_entropy

    def to_sample(self, record: dict) -> dict:
        weight = record.get("weight")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or weight <= 0:
            raise RowError("bad weight", f"`weight` must be a positive number, got {weight!r}")
        rest = {k: v for k, v in record.items() if k != "weight"}
        return {**chat_sample(rest), "weight": float(weight)}

    def encode(self, samples: list[dict]) -> EncodeResult:
        d = self.data
        encoded, _ = encode_chat_samples(
            self.tokenizer, samples, d.max_length, "delete", d.loss_scope
        )
        if len(encoded) != len(samples):
            raise ValueError("weighted_sft needs every sample to fit --max_length")
        for sample, source in zip(encoded, samples, strict=True):
            sample["token_weight"] = [source["weight"]] * len(sample["input_ids"])
        return EncodeResult(encoded)

    def cache_options(self) -> dict:
        return {"method": self.name, "max_length": self.data.max_length}

    length = staticmethod(token.token_lengths)

    def masked(self, sample: dict) -> dict:
        return {**token.without_labels(sample), "token_weight": [0.0] * len(sample["input_ids"])}

    def collate(self, layout: Layout) -> dict:
        if layout.packed:
            return collate_packed(layout.rows, self.pad_id, self.collate_pads)
        return collate([row[0] for row in layout.rows], self.pad_id, self.collate_pads)

    def prepare_model(self, model, log) -> None:
        self.fused = self.fused and install_fused_lm_head(model)

    @staticmethod
    def _shifted_weights(batch: dict) -> torch.Tensor:
        """The weight of the token each position predicts, 0 where nothing is predicted."""
        weights = F.pad(batch["token_weight"][:, 1:], (0, 1), value=0.0)
        targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        return weights * (targets != IGNORE_INDEX)

    def normalizer(self, batch: dict) -> float:
        return float(self._shifted_weights(batch).sum())

    def loss(self, model, batch: dict):
        loss_fn = fused_causal_lm_loss if self.fused else causal_lm_loss
        token_losses, _ = loss_fn(model, batch, reduction="token")
        weights = self._shifted_weights(batch).to(token_losses.device)
        return (token_losses.float() * weights).sum(), {"weighted_tokens": weights.sum()}

    def pipeline_loss(self, logits, batch):
        raise NotImplementedError("weighted_sft has no pipeline form")


# ---- the tests ------------------------------------------------------------------------------

ROWS = [
    {
        "weight": 0.5 + (i % 4),
        "messages": [
            {"role": "user", "content": f"Question number {i}?"},
            {"role": "assistant", "content": f"Answer number {i} is {i * 7}."},
        ],
    }
    for i in range(16)
]
STEPS = dict(
    lora_dropout=0, learning_rate="1e-2", max_steps=4, save_steps=2, split_dataset_ratio=0.25
)


@pytest.mark.numerics
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_weighted_loss_matches_the_formula(tiny_model_dir, tiny_tokenizer, fused):
    """The method's loss and normalizer against per-sample cross-entropy written out."""
    from transformers import AutoModelForCausalLM

    from tolerance import assert_close, forward_terms  # here: the file also runs as a script

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = TrainConfig()
    cfg.train.fused_cross_entropy = fused
    method = WeightedSFT(cfg, tiny_tokenizer)
    method.prepare_model(model, print)
    assert method.fused == fused
    samples = method.encode([method.to_sample(r) for r in ROWS[:3]]).samples
    expected_sum, expected_norm = 0.0, 0.0
    for row, sample in zip(ROWS[:3], samples, strict=True):
        ids = torch.tensor([sample["input_ids"]])
        logits = model(ids).logits[0, :-1]
        targets = torch.tensor(sample["labels"][1:])
        keep = targets != IGNORE_INDEX
        ce = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
        expected_sum += row["weight"] * float(ce.detach())
        expected_norm += row["weight"] * int(keep.sum())
    # Padded or packed batches against each sample alone: a weighted sum of cross-entropies
    # (one sign) behind rows of up to all three samples' tokens.
    terms = forward_terms(sum(len(s["input_ids"]) for s in samples))
    for packed in (False, True):
        rows = [samples] if packed else [[s] for s in samples]
        batch = method.collate(Layout(rows=rows, packed=packed))
        loss_sum, _ = method.loss(model, batch)
        assert method.normalizer(batch) == expected_norm  # weights k + 0.5 times counts: exact
        assert_close(loss_sum.detach(), expected_sum, terms=terms, what="weighted loss sum")


def test_a_bad_weight_names_the_row(tiny_model_dir, tmp_path, capsys):
    from conftest import write_jsonl

    data = write_jsonl(tmp_path / "w.jsonl", [ROWS[0], {**ROWS[1], "weight": -1}])
    out = tmp_path / "run"  # not tmp_path itself: it holds the data, and a run needs its own
    argv = ["--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(out)]
    assert main(argv) == 1  # the script's main, as `python test_custom_method.py` runs it
    assert "w.jsonl:2: `weight` must be a positive number, got -1" in capsys.readouterr().err


def torchrun_this_script(argv: list[str], port: int, subprocess_launch: bool) -> None:
    """This file as a training script on 2 gloo ranks: `torchrun` as a user types it (a
    subprocess, fresh interpreters), or its agent in this process with warm workers."""
    from warm_launch import torchrun_script

    torchrun_args = ["--nproc_per_node=2", f"--master_port={port}", __file__, *argv]
    if not subprocess_launch:
        torchrun_script(torchrun_args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.numerics
def test_custom_method_trains_alike_in_one_process_ddp_and_fsdp2(tiny_model_dir, tmp_path):
    from conftest import logged, tiny_sft, write_jsonl
    from tolerance import assert_close, assert_trained_weights_close, forward_terms

    data = write_jsonl(tmp_path / "weighted.jsonl", ROWS)
    runs = {
        "single": dict(per_device_train_batch_size=4),
        "ddp": dict(per_device_train_batch_size=2, gradient_accumulation_steps=1),
        "fsdp2": dict(per_device_train_batch_size=2, fsdp="fsdp2"),
    }
    argv = {name: tiny_sft(tiny_model_dir, data, tmp_path / name, **STEPS, **flags)[1:]
            for name, flags in runs.items()}  # fmt: skip
    assert main(argv["single"]) == 0  # in this process: the function the script runs
    torchrun_this_script(argv["ddp"], port=29731, subprocess_launch=True)
    torchrun_this_script(argv["fsdp2"], port=29732, subprocess_launch=False)
    single = logged(tmp_path / "single")
    assert len(single) == 4 and single[-1] < single[0]
    # A weighted-token count over a step's samples divided by the same count: 1 up to the
    # rounding of those sums (and the all-reduce of two ranks').
    count_terms = len(ROWS) + 2
    assert_close(logged(tmp_path / "single", "weighted_tokens")[0], 1.0, terms=count_terms)
    terms = forward_terms(tokens=64) + 2  # rows shorter than 64 tokens; the all-reduce of 2
    for name in ("ddp", "fsdp2"):
        assert_close(logged(tmp_path / name), single, terms=terms, what=f"{name} loss")
        # Metric sums are added over ranks and divided by the step's normalizer, as the loss.
        weighted = logged(tmp_path / name, "weighted_tokens")
        assert_close(weighted, [1.0] * 4, terms=count_terms, what=f"{name} weighted_tokens")
        # Evaluation runs the method's loss and metrics on the held-out quarter, every 2 steps.
        evals = logged(tmp_path / name, "eval_loss")
        want = logged(tmp_path / "single", "eval_loss")
        assert_close(evals, want, terms=terms, what=f"{name} eval_loss")
        weighted = logged(tmp_path / name, "eval_weighted_tokens")
        assert_close(weighted, [1.0, 1.0], terms=count_terms, what=f"{name} eval_weighted_tokens")
        adapter = "adapter_model.safetensors"
        a, b = tmp_path / "single" / "final" / adapter, tmp_path / name / "final" / adapter
        assert_trained_weights_close(a, b, learning_rate=1e-2, steps=4)


def main(argv: list[str]) -> int:
    from swiftlm.cli.main import quiet_libraries
    from swiftlm.config.parse import parse_config
    from swiftlm.errors import SwiftLMError
    from swiftlm.train.run import run_method

    cfg = parse_config(TrainConfig, argv, "weighted_sft", WeightedSFT.__doc__)
    quiet_libraries()
    try:
        run_method(cfg, WeightedSFT)
    except SwiftLMError as exc:
        print(f"weighted_sft: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
