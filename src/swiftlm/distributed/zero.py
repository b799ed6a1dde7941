"""DeepSpeed ZeRO 1/2/3 (with CPU offload): optimizer state, gradients and (stage 3)
parameters partitioned over data-parallel ranks.

`--deepspeed zero1|zero2|zero3|zero2_offload|zero3_offload` picks a JSON shipped in
`swiftlm/assets/deepspeed/`; `--deepspeed path.json` takes your own. `"auto"` values are
filled from the swiftlm config (micro-batch, accumulation, clipping, dtype). swiftlm keeps its
own loop: DeepSpeed's engine does the backward, the partitioned update and the checkpoint.
"""

import json
import os
from contextlib import nullcontext
from importlib.resources import files
from pathlib import Path

import torch

from swiftlm.checkpoint.deepspeed import load_engine_state, save_engine_state
from swiftlm.checkpoint.folders import save_pretrained_atomically
from swiftlm.distributed.env import DistContext, init_single_process_group
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.distributed.parallelize import ParallelizeOptions, parallelize, vision_modules
from swiftlm.errors import ConfigError
from swiftlm.train.config import TrainArguments

BUILTIN_CONFIGS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


def load_deepspeed_config(spec: str) -> dict:
    """A built-in config name or a JSON file path."""
    if spec in BUILTIN_CONFIGS:
        return json.loads((files("swiftlm") / "assets" / "deepspeed" / f"{spec}.json").read_text())
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--deepspeed {spec}: not a file; use one of {', '.join(BUILTIN_CONFIGS)} or a JSON path"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--deepspeed {spec}: invalid JSON ({exc})") from None


def fill_auto(config: dict, train: TrainArguments, compute_dtype: torch.dtype) -> dict:
    """Replace DeepSpeed `"auto"` values with the swiftlm settings they mirror."""
    values = {
        # `auto` (0) is resolved after the engine is configured; DeepSpeed only logs this.
        "train_micro_batch_size_per_gpu": max(1, train.per_device_train_batch_size),
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "gradient_clipping": train.max_grad_norm,
    }
    filled = {k: (values.get(k, v) if v == "auto" else v) for k, v in config.items()}
    filled.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = dict(filled.get(name, {}))
        if section.get("enabled") == "auto":
            section["enabled"] = compute_dtype == dtype
        filled[name] = section
    return filled


def forget_earlier_groups() -> None:
    """Drop DeepSpeed's cached copy of the world group before building an engine.

    DeepSpeed keeps a clone of the world group in a module global. After an earlier run in
    this process (tests, a notebook) destroyed its process group, that clone is stale and
    `deepspeed.initialize` fails ("Group ... is not registered"); cleared, it is made again
    from the current group. A no-op for the first engine of a process (every torchrun worker).
    """
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None


class DeepSpeedStrategy:
    """The wrapper exception: DeepSpeed's engine owns the model and the optimizer, so `wrap`
    applies only what the engine does not (activation checkpointing, compile) and
    `attach_optimizer` builds the engine."""

    pipeline_parallel = False

    def __init__(
        self,
        ctx: DistContext,
        device: torch.device,
        spec: str,
        train: TrainArguments,
        compute_dtype: torch.dtype,
        options: ParallelizeOptions | None = None,
    ):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--deepspeed needs DeepSpeed: pip install 'swiftlm[deepspeed]'"
            ) from None
        self.ctx, self.device, self.spec = ctx, device, spec
        self.options = options or ParallelizeOptions()
        self.config = fill_auto(load_deepspeed_config(spec), train, compute_dtype)
        self.stage = int(self.config.get("zero_optimization", {}).get("stage", 0))
        self.engine = None
        self.dp_rank, self.dp_size = ctx.rank, ctx.world_size
        self.sp_rank, self.sp_size = 0, 1

    def __str__(self) -> str:
        ranks = "rank" if self.ctx.world_size == 1 else "ranks"
        return f"DeepSpeed {self.spec} over {self.ctx.world_size} {ranks}"

    def wrap(self, model):
        self.refuse_skipped_vision(model)
        # The engine shards by itself: of the parallelize sequence, only activation
        # checkpointing and compile apply (dims of one rank).
        parallelize(model, ParallelDims(), None, self.device, self.options)
        return model  # the engine needs the optimizer: see attach_optimizer

    def refuse_skipped_vision(self, model) -> None:
        """A rank whose micro-batch has no image skips a vision-language model's vision
        encoder and aligner. ZeRO-3 gathers their parameters as they run, and ZeRO-1/2 reduce
        trained parameters' gradients in buckets filled as they arrive, so the other rank would
        wait for collectives never made (a hang, or gloo's size mismatch): refused."""
        vision = vision_modules(model)
        if self.ctx.world_size == 1 or not vision:
            return
        trained = any(p.requires_grad for m in vision for p in m.parameters())
        if self.stage < 3 and not trained:
            return
        model_type = model.config.model_type
        why = (
            "gathers the vision encoder's parameters as it runs"
            if self.stage == 3
            else "reduces the trained vision parts' gradients in buckets"
        )
        raise ConfigError(
            f"--deepspeed {self.spec} with a vision-language model ({model_type}) on "
            f"{self.ctx.world_size} ranks: a rank whose micro-batch has no image skips the "
            f"vision encoder, while ZeRO-{self.stage} {why} on every rank, so the ranks would "
            "wait for each other forever; use --strategy fsdp2 or ddp"
            + ("" if self.stage == 3 else ", or keep --freeze_vit and --freeze_aligner true")
        )

    def attach_optimizer(self, model, optimizer):
        """Build the DeepSpeed engine around the model and swiftlm's own AdamW."""
        import deepspeed

        if not self.ctx.distributed:
            # The engine always talks to a process group; alone, it is a group of one (shut
            # down with any other by shutdown_distributed at the end of the run).
            init_single_process_group(self.device)
        forget_earlier_groups()
        self.engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.config
        )
        return self.engine, ds_optimizer

    def unwrap(self, model):
        return model.module if hasattr(model, "module") else model

    def no_sync(self, model, sync: bool):
        return nullcontext()  # the engine knows the accumulation boundary itself

    def backward(self, loss, last_micro_batch: bool) -> None:
        # The loop already divides by the step's normalizer; no extra 1/accumulation.
        self.engine.backward(loss, scale_wrt_gas=False)
        if not last_micro_batch:
            self.engine.step()  # advances the engine's micro-step counter; no update yet

    def clip_and_step(self, model, optimizer, max_norm: float, scaler) -> float:
        self.engine.step()  # clips (gradient_clipping) and updates at the boundary
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def step_metrics(self) -> dict:
        return {}

    def pipeline_step(self, method, batches, scale, autocast) -> float:
        raise RuntimeError("DeepSpeed runs the loop's micro-batches; it has no pipeline schedule")

    def save_state(self, folder: Path, model, optimizer) -> None:
        save_engine_state(folder, self.engine)
        self._save_pretrained(folder, tokenizer=None)

    def load_state(self, folder: Path, model, optimizer) -> None:
        load_engine_state(folder, self.engine)

    def save_final(self, model, tokenizer, folder: Path) -> None:
        self._save_pretrained(folder, tokenizer)
        self.ctx.barrier()

    def _save_pretrained(self, folder: Path, tokenizer) -> None:
        """A consolidated Hugging Face folder (or peft adapter) written by rank 0."""
        module = self.engine.module
        # Under ZeRO-3 every rank holds a shard: all of them take part in the gather.
        state = self.engine._zero3_consolidated_16bit_state_dict() if self.stage == 3 else None
        if not self.ctx.is_main:
            return
        if state is None:
            state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        if tokenizer is None:  # inside a checkpoint folder, whose COMPLETE marker comes last
            module.save_pretrained(folder, state_dict=state, safe_serialization=True)
        else:
            save_pretrained_atomically(module, tokenizer, folder, state_dict=state)
