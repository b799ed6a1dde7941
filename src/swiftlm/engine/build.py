"""Build an engine for a model folder: load the model, its tokenizer and its adapters.

`InferenceModel` is what a command resolved its model flags to (`checkpoint.resolve`: a
model, a run or adapters); `engine_for_model` builds its engine: the continuous-batching
engine, or a vision-language model's `vision.VisionEngine` (continuous batching is text-only).
`build_engine` starts the continuous-batching engine over a model folder or hub id.
`swiftlm deploy` and `swiftlm eval` start from these, `swiftlm infer` wraps the same engines
in `infer.frontend.ChatEngine` (GRPO's and GKD's rollouts run the engine over the live policy
instead: `methods/rl/rollout.py`). Adapters come in two kinds:
merged ones (folded into the base weights: as fast as the plain model, they can stack) and
named ones (kept apart as peft LoRA layers, chosen per request by `GenerationRequest.adapter`,
all sharing one copy of the base weights and one batch).

Unlike the engine's core (`continuous.py` and what it runs), this module reads files: model
folders, adapter folders, the model's flags.
"""

import logging
import warnings
from dataclasses import dataclass

from swiftlm.engine.continuous import ContinuousEngine, stop_token_ids
from swiftlm.engine.packed_weights import pack_linear_weights, why_not_packable
from swiftlm.engine.speculation import Speculation
from swiftlm.engine.vision import build_vision_engine, is_vision_model
from swiftlm.engine.vllm_backend import VllmOptions
from swiftlm.errors import ConfigError, ModelLoadError
from swiftlm.models.config import ModelArguments
from swiftlm.models.loader import load_model, load_tokenizer, pick_device, pick_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InferenceModel:
    """Everything needed to build an inference engine, with paths already resolved."""

    base_path: str  # what `from_pretrained` loads: a local folder or a hub id
    adapters: tuple[str, ...]  # adapter folders, applied in order on the base
    tokenizer_path: str  # the adapter/final folder when it has tokenizer files, else the base
    system: str | None  # system prompt for conversations that have none
    torch_dtype: str  # --torch_dtype, or the run's when the user left it at auto
    description: str  # one line for the console: what was loaded
    ckpt_dir: str | None = None  # where batch results go by default (the run dir if known)
    base_name: str | None = None  # the base model's short name, when a base was resolved
    max_pixels: int = 0  # --max_pixels, or the run's when the user left it at 0 (images)


@dataclass(frozen=True)
class EngineOptions:
    """How a command's engine is chosen and tuned: the `--infer_backend`,
    `--prefix_cache_memory`, `--speculative_tokens`, `--packed_weights` and `--vllm_*` flags."""

    infer_backend: str = "pt"
    prefix_cache_memory: int = 0  # MiB of swiftlm's prefix cache (0: none); pt only
    speculative_tokens: int = 0  # prompt-lookup draft tokens per step (0: no speculation)
    packed_weights: str = "auto"  # auto | true | false: oneDNN-packed linears; pt only
    vllm: VllmOptions = VllmOptions()

    @classmethod
    def of(cls, infer) -> "EngineOptions":
        """The options of a command's `InferArguments`."""
        return cls(
            infer_backend=infer.infer_backend,
            prefix_cache_memory=infer.prefix_cache_memory,
            speculative_tokens=infer.speculative_tokens,
            packed_weights=infer.packed_weights,
            vllm=VllmOptions(
                gpu_memory_utilization=infer.vllm_gpu_memory_utilization,
                tensor_parallel_size=infer.vllm_tensor_parallel_size,
                enforce_eager=infer.vllm_enforce_eager,
            ),
        )


def engine_for_model(
    spec: InferenceModel,
    model_args: ModelArguments,
    seed: int,
    max_num_seqs: int = 32,
    adapters: dict[str, str] | None = None,
    max_model_len: int | None = None,
    max_pixels: int = 0,
    options: EngineOptions = EngineOptions(),
):
    """The engine for a resolved model: its run adapters merged in, `adapters` (name -> folder)
    served unmerged beside it (`swiftlm deploy`). A vision-language model gets a
    `VisionEngine` (transformers' generate, one request at a time: continuous batching is
    text-only); `--infer_backend vllm` a `vllm_backend.VllmEngine`."""
    engine_args = dict(
        tokenizer_path=spec.tokenizer_path,
        merge_adapters=spec.adapters,
        adapters=adapters,
        torch_dtype=spec.torch_dtype,
        device=model_args.device,
        max_model_len=max_model_len,
        seed=seed,
    )
    vision = is_vision_model(spec.base_path)
    check_backend(options, spec.base_path, vision)
    if options.infer_backend == "vllm":
        from swiftlm.engine.vllm_backend import build_vllm_engine

        return build_vllm_engine(
            spec.base_path,
            max_num_seqs=max_num_seqs,
            speculative_tokens=options.speculative_tokens,
            options=options.vllm,
            **engine_args,
        )
    if vision:
        if options.speculative_tokens:
            raise ConfigError(
                f"--speculative_tokens {options.speculative_tokens}: {spec.base_path} is a "
                "vision-language model, answered one request at a time through transformers' "
                "generate, which has no speculative decoding here; drop the flag"
            )
        return build_vision_engine(
            spec.base_path, max_pixels=max_pixels, attn_impl=model_args.attn_impl, **engine_args
        )
    return build_engine(
        spec.base_path,
        max_num_seqs=max_num_seqs,
        attn_impl=model_args.attn_impl,
        experts_impl=model_args.experts_impl,
        prefix_cache_bytes=options.prefix_cache_memory * 2**20,
        speculation=Speculation(options.speculative_tokens) if options.speculative_tokens else None,
        packed_weights=options.packed_weights,
        **engine_args,
    )


def check_backend(options: EngineOptions, model_path: str, vision: bool) -> None:
    """Refuse, by name, a backend that cannot serve this model."""
    if options.infer_backend == "sglang":
        raise ConfigError(
            "--infer_backend sglang: not built yet (SGLang's package does not run on CPU "
            "machines, where swiftlm is tested); use --infer_backend vllm or pt"
        )
    if options.infer_backend == "vllm" and vision:
        raise ConfigError(
            f"--infer_backend vllm: {model_path} is a vision-language model, and swiftlm "
            "passes only text prompts to vLLM so far; use --infer_backend pt"
        )
    if options.packed_weights == "true" and (options.infer_backend != "pt" or vision):
        which = "a vision-language model" if vision else f"--infer_backend {options.infer_backend}"
        raise ConfigError(
            f"--packed_weights true: packing is for swiftlm's continuous-batching engine over a "
            f"text model, not for {which}; drop the flag (or use auto)"
        )


def build_engine(
    model_path: str,
    *,
    tokenizer_path: str | None = None,
    merge_adapters: tuple[str, ...] = (),
    adapters: dict[str, str] | None = None,
    torch_dtype: str = "auto",
    device: str = "auto",
    attn_impl: str = "sdpa",
    experts_impl: str = "grouped_mm",
    max_num_seqs: int = 32,
    max_model_len: int | None = None,
    prefill_chunk_tokens: int = 1024,
    seed: int = 0,
    warmup: bool = True,
    prefix_cache_bytes: int = 0,
    speculation: Speculation | None = None,
    packed_weights: str = "auto",
) -> ContinuousEngine:
    """Load `model_path` (a local folder or hub id: see `models.loader.resolve_model`) and
    start its engine. `adapters` maps served names to adapter folders; `max_model_len`
    defaults to the model's context length, at most 4096 (`continuous.DEFAULT_MAX_MODEL_LEN`);
    `packed_weights` is the flag's auto | true | false (`packed_weights.py`)."""
    torch_device = pick_device(device)
    dtype = pick_dtype(torch_dtype, torch_device)
    tokenizer = load_tokenizer(tokenizer_path or model_path)
    model = load_model(model_path, dtype, torch_device, attn_impl, experts_impl=experts_impl)
    model = apply_adapters(model, merge_adapters)
    model = load_named_adapters(model, adapters or {})
    pack_weights(model, packed_weights)
    engine = ContinuousEngine(
        model,
        tokenizer,
        stop_token_ids=stop_token_ids(tokenizer, model),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        prefill_chunk_tokens=prefill_chunk_tokens,
        adapters=tuple(adapters or {}),
        seed=seed,
        prefix_cache_bytes=prefix_cache_bytes,
        speculation=speculation,
    )
    if warmup:
        engine.warmup()
    return engine


def pack_weights(model, mode: str) -> None:
    """`--packed_weights`: pack the linear layers where it applies (auto), refuse where it does
    not (true), or leave them (false)."""
    if mode == "false":
        return
    reason = why_not_packable(model)
    if reason is None:
        log.info("packed %d linear layers for oneDNN", pack_linear_weights(model))
    elif mode == "true":
        raise ConfigError(
            f"--packed_weights true: {reason}; use --packed_weights auto (packs only where "
            "it applies) or false"
        )


def apply_adapters(model, adapters: tuple[str, ...]):
    """Apply each adapter folder in order, merged into the weights.

    Merging makes generation as fast as the plain model (no extra LoRA matmuls) and lets
    several adapters stack; inference never needs them separate.
    """
    if not adapters:
        return model
    from peft import PeftModel

    for folder in adapters:
        with _adapter_errors(f"--adapters {folder}"):
            model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    return model


def load_named_adapters(model, adapters: dict[str, str]):
    """The base model with each adapter as its own unmerged peft adapter, named as given."""
    if not adapters:
        return model
    from peft import PeftModel

    for name, folder in adapters.items():
        with _adapter_errors(f"--adapters {name}={folder}"):
            if isinstance(model, PeftModel):
                model.load_adapter(folder, adapter_name=name)
            else:
                model = PeftModel.from_pretrained(model, folder, adapter_name=name)
    return model.eval()


class _adapter_errors:
    """Turn peft's load errors into a ModelLoadError naming the flag; hide its v5 warning."""

    def __init__(self, flag: str):
        self.flag = flag
        self.warnings = warnings.catch_warnings()

    def __enter__(self):
        self.warnings.__enter__()
        # peft calls a transformers API deprecated in v5; the user can do nothing about it.
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)

    def __exit__(self, kind, exc, tb):
        self.warnings.__exit__(kind, exc, tb)
        if isinstance(exc, (OSError, ValueError, RuntimeError, KeyError)):
            raise ModelLoadError(
                f"{self.flag}: could not apply this adapter to the base model ({exc}); "
                "was it trained on a different base model? Pass the right one with --model"
            ) from exc
        return False
