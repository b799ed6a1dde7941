"""GRPO's rollouts on vLLM in the trainer's process (`--infer_backend vllm`, colocate).

`VllmPolicySampler` has `rollout.PolicySampler`'s interface. Before every generation it
writes the policy's weights, LoRA merged (W + scale * B @ A, computed, so the trained module
is never merged and unmerged), to a safetensors folder in shared memory, and vLLM reloads
them in place (`VllmEngine.reload_weights`, which also drops vLLM's prefix cache: its keys
and values came from the old weights). The first generation starts vLLM on that folder.

vLLM samples with its own kernels, so its log-probs of a completion differ slightly from the
trainer's (`logprob_mismatch` logs the gap); GRPO corrects the policy loss by truncated
importance sampling (`--vllm_importance_sampling_correction`, in grpo.py).
"""

import shutil
import tempfile
from pathlib import Path

import torch

from swiftlm.engine.protocol import GenerationFailed, GenerationRequest, SampleResult
from swiftlm.methods.reference import unwrapped
from swiftlm.methods.rl.rollout import MAX_ENGINE_SEQUENCES, rollout_failed


class VllmPolicySampler:
    def __init__(self, tokenizer, max_model_len: int, enforce_eager: bool, memory_share: float):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.memory_share = memory_share
        self.engine = None
        shared = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self.folder = Path(tempfile.mkdtemp(prefix="swiftlm-vllm-policy-", dir=shared))
        self.syncs = 0  # weight reloads so far (the first generation starts vLLM instead)

    def generate(self, model, requests: list[GenerationRequest]) -> list[list[SampleResult]]:
        self._sync(unwrapped(model))
        try:
            return self.engine.generate(requests)
        except GenerationFailed as exc:
            raise rollout_failed(self.tokenizer, requests, exc) from exc

    def _sync(self, policy) -> None:
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        base.save_pretrained(self.folder, state_dict=merged_state_dict(policy))
        if self.engine is None:
            self.tokenizer.save_pretrained(self.folder)
            self.engine = self._start(next(policy.parameters()).dtype)
        else:
            self.engine.reload_weights(str(self.folder))
            self.syncs += 1

    def _start(self, dtype: torch.dtype):
        from swiftlm.engine.vllm_backend import VllmOptions, build_vllm_engine

        options = VllmOptions(
            gpu_memory_utilization=self.memory_share,
            enforce_eager=self.enforce_eager,
            logprobs_mode="scaled",  # what the trainer recomputes: logits / temperature
        )
        return build_vllm_engine(
            str(self.folder),
            tokenizer_path=str(self.folder),
            torch_dtype=str(dtype).removeprefix("torch."),
            max_num_seqs=MAX_ENGINE_SEQUENCES,
            max_model_len=self.max_model_len,
            options=options,
        )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        shutil.rmtree(self.folder, ignore_errors=True)


@torch.no_grad()
def merged_state_dict(policy) -> dict[str, torch.Tensor]:
    """The policy's weights under the base model's own names, each LoRA layer's update added
    to its base weight (`modules_to_save` copies replace their originals); the trained module
    is left as it is. A plain (full fine-tuning) model's state dict as it is."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(policy, PeftModel):
        return {name: tensor.contiguous() for name, tensor in policy.state_dict().items()}
    adapter = policy.active_adapter
    base = policy.get_base_model()
    state = {}
    for key, tensor in base.state_dict().items():
        if "lora_" in key or ".original_module." in key:
            continue
        key = key.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        state[key] = tensor
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            key = f"{name}.weight"
            state[key] = state[key] + module.get_delta_weight(adapter).to(state[key].dtype)
    return {key: tensor.contiguous() for key, tensor in state.items()}
