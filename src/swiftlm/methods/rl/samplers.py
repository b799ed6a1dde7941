"""Which engine an online method (GRPO, GKD) samples its policy on: `--infer_backend pt`
(swiftlm's engine over the live module, `rollout.PolicySampler`), or vLLM colocated in the
trainer's process (`vllm_rollout.VllmPolicySampler`) or behind a `swiftlm rollout` server
(`vllm_server.VllmServerSampler`). All three take the same requests and return the same
samples, so the methods do not know which one runs."""

import dataclasses
from collections.abc import Callable

from swiftlm.errors import ConfigError
from swiftlm.methods.rl.online import sharded_by_fsdp2
from swiftlm.methods.rl.rollout import PolicySampler


def policy_sampler(cfg, tokenizer):
    """The sampler of the policy being trained, as the flags choose (nothing starts yet)."""
    g = cfg.grpo
    if g.infer_backend == "pt":
        return PolicySampler(tokenizer, cfg.data.max_length, sharded_by_fsdp2(cfg))
    if g.vllm_mode == "server":
        from swiftlm.methods.rl.vllm_server import VllmServerSampler

        return VllmServerSampler(tokenizer, g)
    from swiftlm.methods.rl.vllm_rollout import VllmPolicySampler

    return VllmPolicySampler(
        tokenizer, cfg.data.max_length, g.vllm_enforce_eager, g.vllm_gpu_memory_utilization
    )


def check_sampler_layout(cfg) -> None:
    """--infer_backend vllm samples with one vLLM engine (in the trainer's process or a
    server's) for one trainer process, from merged weights: refuse what that cannot be, and
    a --vllm_* flag set without it (it would change nothing)."""
    if cfg.grpo.infer_backend != "vllm":
        _refuse_vllm_flags(cfg.grpo)
        return
    train_type = cfg.tuner.train_type
    refused = {**one_process_layout(cfg), f"--train_type {train_type}": train_type == "dora"}
    refuse_given(
        refused,
        lambda flag: (
            f"{flag}: not available with --infer_backend vllm yet (rollouts on vLLM "
            "run for one trainer process, from its merged LoRA or full weights); use "
            "--infer_backend pt"
        ),
    )


def one_process_layout(cfg) -> dict[str, bool]:
    """Per flag, whether it is set to what a sampler held by one trainer process, over the
    unquantized policy, cannot serve: more processes, or a quantized base."""
    d = cfg.dist
    return {
        f"--nproc_per_node {d.nproc_per_node}": d.nproc_per_node > 1,
        f"--nnodes {d.nnodes}": str(d.nnodes) != "1",
        f"--strategy {d.strategy}": d.strategy not in ("auto", "single", "ddp"),
        f"--quant_method {cfg.quant.quant_method}": cfg.quant.quant_method is not None,
    }


def refuse_given(refused: dict[str, bool], message: Callable[[str], str]) -> None:
    """Raise ConfigError with `message(flag)` for the first flag that is set."""
    for flag, given in refused.items():
        if given:
            raise ConfigError(message(flag))


def _refuse_vllm_flags(args) -> None:
    for field in dataclasses.fields(args):
        if field.name.startswith("vllm_") and getattr(args, field.name) != field.default:
            raise ConfigError(
                f"--{field.name} {getattr(args, field.name)}: only with --infer_backend vllm "
                "(the rollouts run on swiftlm's engine); add --infer_backend vllm or drop it"
            )
