"""A training method with a reference model and rollouts, defined in this file only and
registered with one call (docs/architecture.md, "Adding a method"): REINFORCE with a k3 KL
penalty to the reference. Each step it samples completions of its prompts on swiftlm's
engine from the live policy, scores them (the share of even token ids: a toy reward with a
spread on a random model), and trains on them through
swiftlm's own loop; no file outside this test changes.

The class inherits nothing from swiftlm: it defines `methods.base.Method`'s members and the
capabilities it has (`step_batches`, `step_metrics`, `close`); `complete_method` gives it the
defaults of the others (no state kept across steps, evaluation = the loss ...).
"""

import json

import pytest
import torch

from conftest import write_jsonl
from plugin_isolation import isolated_plugins  # noqa: F401 (the fixture)
from swiftlm import plugins
from swiftlm.cli.main import main
from swiftlm.data.encode import IGNORE_INDEX, TruncationReport
from swiftlm.data.prompts import prompt_sample
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.losses.causal_lm import shifted_labels, token_cross_entropy
from swiftlm.losses.rl import k3_kl
from swiftlm.methods.base import EncodeResult, Layout
from swiftlm.methods.reference import Reference
from swiftlm.methods.rl.online import prompt_ids
from swiftlm.methods.rl.rollout import PolicySampler, completion_rows, rollout_seed

SAMPLES_PER_PROMPT, MAX_NEW_TOKENS = 2, 6
FIRST_STEP: dict = {}  # what the method trained on at step 1, for the independent check


def even_share(token_ids: list[int]) -> float:
    return sum(t % 2 == 0 for t in token_ids) / max(len(token_ids), 1)


class ReinforceKL:
    """loss = sum over completions of -(advantage x its log-prob sum) + beta x k3 KL sum; the
    advantage is the reward minus its prompt's mean; normalized by the completions."""

    name = "reinforce_kl"
    columns = ("prompt_ids", "weight")
    supports_packing = False
    default_datasets = ()

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer, self.beta = cfg, tokenizer, cfg.rlhf.beta
        self.token_pads = {"input_ids": tokenizer.pad_token_id, "labels": IGNORE_INDEX}
        self.reference = Reference(cfg, self.name)
        self.sampler = PolicySampler(tokenizer, cfg.data.max_length)
        self.metrics: dict[str, float] = {}

    # -- data: prompts -------------------------------------------------------------------------

    def to_sample(self, record: dict) -> dict:
        return prompt_sample(record, method=f"swiftlm rlhf --rlhf_type {self.name}")

    def encode(self, samples: list[dict]) -> EncodeResult:
        budget = self.cfg.data.max_length - MAX_NEW_TOKENS
        report = TruncationReport("delete", budget)
        ids = [prompt_ids(self.tokenizer, s["prompt"], budget, "delete", report) for s in samples]
        return EncodeResult([{"prompt_ids": i, "weight": 1.0} for i in ids if i is not None])

    def cache_options(self) -> dict:
        return {"method": self.name, "max_length": self.cfg.data.max_length}

    def length(self, sample: dict) -> int:
        return len(sample["prompt_ids"]) + MAX_NEW_TOKENS

    def masked(self, sample: dict) -> dict:
        return {**sample, "weight": 0.0}

    def collate(self, layout: Layout) -> dict:
        return {"prompts": [row[0] for row in layout.rows]}

    # -- rollouts ------------------------------------------------------------------------------

    def prepare_model(self, model, log) -> None:
        self.reference.prepare(model, log)

    def step_batches(self, model, context) -> list[dict]:
        """Each prompt micro-batch of the step becomes one micro-batch of its completions."""
        return [self._rollout(model, batch["prompts"], context) for batch in context.draw()]

    def _rollout(self, model, prompts: list[dict], context) -> dict:
        requests = [
            GenerationRequest(
                p["prompt_ids"],
                SamplingParams(
                    max_tokens=MAX_NEW_TOKENS,
                    n=SAMPLES_PER_PROMPT,
                    seed=rollout_seed(self.cfg.train.seed, context.step, p["prompt_ids"]),
                    logprobs=True,
                    logprobs_mode="scaled",
                ),
            )
            for p in prompts
        ]
        with context.phase("generation"):
            groups = self.sampler.generate(model, requests)
        rows = [(p, s) for p, group in zip(prompts, groups, strict=True) for s in group]
        rewards = torch.tensor([even_share(s.token_ids) for _, s in rows])
        by_prompt = rewards.view(len(prompts), SAMPLES_PER_PROMPT)
        advantages = (by_prompt - by_prompt.mean(dim=1, keepdim=True)).flatten()
        batch = completion_rows(
            [p["prompt_ids"] for p, _ in rows],
            [list(s.token_ids) for _, s in rows],
            [[t.logprob for t in s.logprobs] for _, s in rows],
            self.tokenizer.pad_token_id,
        )
        batch["advantages"] = advantages
        batch["weight"] = torch.tensor([p["weight"] for p, _ in rows])
        self.metrics = {"reward": float(rewards.mean())}
        if context.step == 1 and not FIRST_STEP:
            FIRST_STEP.update({k: v.clone() for k, v in batch.items()})
        return batch

    def step_metrics(self) -> dict[str, float]:
        return self.metrics

    def close(self) -> None:
        self.sampler.close()

    # -- loss ----------------------------------------------------------------------------------

    @staticmethod
    def normalizer(batch: dict) -> torch.Tensor:
        return batch["weight"].sum()

    def token_logps(self, model, batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return -token_cross_entropy(logits.float(), batch["labels"])

    def loss(self, model, batch: dict):
        mask = (shifted_labels(batch["labels"]) != IGNORE_INDEX).float()
        mask = mask * batch["weight"].unsqueeze(1)
        logps = self.token_logps(model, batch)
        with torch.no_grad():
            reference, context = self.reference.module(model)
            with context:
                ref_logps = self.token_logps(reference, batch)
        kl = (k3_kl(logps, ref_logps) * mask).sum(dim=1)
        policy = -(batch["advantages"] * (logps * mask).sum(dim=1))
        return (policy + self.beta * kl).sum(), {"kl": kl.detach().sum()}


ROWS = [{"messages": [{"role": "user", "content": f"Count to {i}, briefly."}]} for i in range(8)]


@pytest.mark.numerics
@pytest.mark.usefixtures("isolated_plugins")
def test_a_method_with_a_reference_and_rollouts_trains_from_this_file_alone(
    tiny_model_dir, tmp_path
):
    from transformers import AutoModelForCausalLM

    plugins.register_method(ReinforceKL.name, ReinforceKL, rlhf=True, beta=0.1)
    FIRST_STEP.clear()
    out = tmp_path / "run"
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    argv = ["rlhf", "--rlhf_type", ReinforceKL.name, "--model", str(tiny_model_dir)]
    argv += ["--dataset", str(data), "--output_dir", str(out), "--torch_dtype", "float32"]
    argv += ["--report_to", "none", "--logging_steps", "1", "--max_steps", "3"]
    argv += ["--per_device_train_batch_size", "2", "--learning_rate", "5e-2", "--seed", "3"]
    assert main(argv) == 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("reward" in r and "kl" in r for r in steps)  # step_metrics and loss metrics
    # Step 1: the LoRA policy is the reference (B = 0), so the KL is 0 to rounding; later
    # steps have moved away from it.
    assert abs(steps[0]["kl"]) < 1e-6 and steps[-1]["kl"] > 1e-6

    # The first step's loss, recomputed with transformers on what the method trained on.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    batch = FIRST_STEP
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logps = torch.log_softmax(logits.logits.double(), dim=-1)[:, :-1]
    targets = batch["input_ids"][:, 1:]
    completion = (batch["labels"][:, 1:] != IGNORE_INDEX).double()
    token_logps = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * completion
    expected = -(batch["advantages"].double() * token_logps.sum(dim=1)).sum()
    expected = expected / batch["weight"].sum()
    # float32 log-probs of ~10^1 over ~10^1 tokens: ~1e-5 absolute is the rounding's scale.
    assert steps[0]["loss"] == pytest.approx(float(expected), abs=1e-4)
    # The engine sampled from the weights the trainer scored (float32 both): the same
    # log-probs of the sampled tokens, to float32 rounding.
    engine = (batch["engine_logps"][:, :-1].double() * completion).sum()
    assert float(engine) == pytest.approx(float(token_logps.sum()), abs=1e-3)
