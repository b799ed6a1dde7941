"""What a training method is: the unit of extension of swiftlm's training.

SFT, pre-training, DPO, GRPO ... differ only by what they read, what they encode, how they
batch it and what they optimize. A method owns exactly that and nothing else; the loop, the
distribution strategies, the tokenized-data cache and the CLI plumbing are shared:

    rows ──to_sample──▶ samples ──encode──▶ encoded samples (the method's `columns`,
    cached as Arrow) ──collate──▶ micro-batch tensors ──loss──▶ (loss_sum, metrics)

Normalization (torchtitan's "the loss receives the global number of valid tokens"): the
loop sums `normalizer(batch)` over every micro-batch of an optimizer step and over the
data-parallel ranks *before* any forward pass, and divides each micro-batch's `loss_sum` by
that total. The gradient is then the gradient of the step's mean loss whatever the split
into micro-batches and ranks. A method therefore returns a SUM (over tokens, sequences or
pairs) and says, from the batch alone, how many units that sum is over.

Metrics follow the same rule: `loss` returns sums, the loop adds them over micro-batches and
ranks and logs each one divided by the step's normalizer.

The contract has two halves. `Method` lists what every method defines. `MethodDefaults`
holds the optional capabilities (a reference model's values computed once, sampling its own
micro-batches, state kept across steps, evaluation other than the loss ...), each with the
behaviour of a method that does not have it. `complete_method` checks a method class once,
when a run builds it, and gives it the defaults it lacks, so the loop calls every capability
on every method and never asks which one it has.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swiftlm.errors import ConfigError
from swiftlm.models.loader import CAUSAL_LM

Batch = dict[str, torch.Tensor]
LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    """How the samples of a micro-batch are laid out in tensors (chosen by the loop's plan).

    `rows` lists, per tensor row, the encoded samples it holds. `packed` False: one sample per
    row, right-padded. `packed` True: several samples per row (packing, padding-free), with
    position ids restarting per sample.
    """

    rows: list[list[dict]]
    packed: bool


@dataclass
class EncodeResult:
    """Encoded samples of one split and the lines to print about them (kept with the cache)."""

    samples: list[dict]
    log: list[str] = field(default_factory=list)
    # TruncationReport.as_dict(): the counts behind the log line, for the data-health summary
    truncation: dict = field(default_factory=dict)
    # Local files read besides the data files (images): the cache re-encodes when one changes
    files_read: list[str] = field(default_factory=list)


class Method(Protocol):
    """A training method. Instances are built per run by `build(cfg, tokenizer)`.

    Attributes:
        name: the `--rlhf_type`/subcommand name, e.g. "sft".
        columns: the columns `encode` produces; the cache stores exactly these.
        token_pads: the token-aligned batch tensors (shape [rows, width]) and the value
            that pads them; pipeline parallel pads them to --max_length.
        supports_packing: whether rows may hold several samples (packing, padding-free).
        default_datasets: what the method trains on when no --dataset is given (the
            built-in default job); empty: --dataset is required.

    The optional members are those of `MethodDefaults`.
    """

    name: str
    columns: tuple[str, ...]
    token_pads: dict[str, int | float]
    supports_packing: bool
    default_datasets: tuple[str, ...]

    def to_sample(self, record: dict) -> dict:
        """One dataset row -> a validated sample; raise data.formats.RowError if it is bad."""
        ...

    def encode(self, samples: list[dict]) -> EncodeResult:
        """Validated samples -> encoded samples holding `columns`."""
        ...

    def length(self, sample: dict) -> int:
        """Tokens an encoded sample occupies in a micro-batch (for planning and packing)."""
        ...

    def collate(self, layout: Layout) -> Batch:
        """Encoded samples -> micro-batch tensors."""
        ...

    def normalizer(self, batch: Batch) -> float | torch.Tensor:
        """Units `loss` sums over in this micro-batch (label tokens, pairs, weights ...),
        read from the batch alone: the loop needs it before the forward pass. A tensor
        (0-d) keeps the loop from reading it back to the host."""
        ...

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        """(loss SUM over the micro-batch, metric SUMS) for the (wrapped) model."""
        ...

    def masked(self, sample: dict) -> dict:
        """A copy of an encoded sample that adds nothing to the loss or the normalizer: a
        data-parallel rank with no sample left runs it to keep collectives in step."""
        ...

    def cache_options(self) -> dict[str, Any]:
        """Everything besides the files and the tokenizer that the encoded samples depend on
        (the cache key)."""
        ...


@dataclass
class StepContext:
    """What `step_batches` gets from the loop for one optimizer step."""

    draw: Callable[[], list[Batch]]  # the next optimizer step's micro-batches from the data
    steps_left: int  # optimizer steps still to run, this one included
    step: int  # the optimizer step about to run (1-based)
    strategy: Any  # distributed.strategy.Strategy: ranks, all-reduce
    autocast: Callable[[], Any]  # the training forward's precision context
    # Times a part of the step for the log's breakdown: "generation", "reward", "forward".
    phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext()


class MethodDefaults:
    """The optional capabilities of a method, each as a method without it behaves.

    A built-in method inherits these; `complete_method` adds them to a plugin's class that
    does not. Overriding one is how a method declares the capability.
    """

    # What the model is loaded as (models.loader): "sequence_classification" for a reward
    # model (methods/preference/reward_model.py).
    model_kind: str = CAUSAL_LM
    # Whether the method trains vision-language models (it takes `vision=VisionInputs`).
    supports_images: bool = False
    # Whether a packed row may hold several samples of a vision-language model (where the
    # method supports packing and the model is in data.vision_batch's PACKABLE).
    packs_images: bool = True
    # Rows the batch plan counts per sample: GRPO's micro-batch of completions holds
    # per_device_train_batch_size / num_generations prompts.
    completions_per_sample: int = 1
    # Samples per evaluation batch (None: --per_device_eval_batch_size); a method that
    # generates evaluates many prompts per engine call.
    eval_batch_size: int | None = None
    # Whether `state_dict()` is state that checkpoints keep and a resume restores (an online
    # method's completions sampled but not yet trained on).
    has_step_state: bool = False
    # Sequence parallel (distributed/sequence_parallel.shard_sequence): the prefixes of the
    # batch's sets of token rows, each cut into shards by its own width, and the per-sample
    # weights only a group's first shard keeps (losses of whole sequences, computed by every
    # rank from log-prob sums gathered over the group, count each sample once).
    sequence_row_sets: tuple[str, ...] = ("",)
    sequence_owned: tuple[str, ...] = ()

    def prepare_model(self, model: torch.nn.Module, log: Callable[[str], None]) -> None:
        """Adjust the loaded, tuned model before any wrapper sees it (install the fused LM
        head, keep a reference model ...)."""

    def prepare_samples(self, model, train: list[dict], val: list[dict], log) -> tuple:
        """(train, val) with values computed once with the prepared model (DPO's precomputed
        reference log-probs); as they are by default."""
        return train, val

    def sharded_data(self, cfg, ctx, log) -> tuple | None:
        """Prepared data of another kind than encoded samples (pt's memory-mapped token
        shards), in `train.prepare.prepare_data`'s return form; None: encode samples."""
        return None

    def chunk_encoder(self):
        """An encoder that streams rows into the cache chunk by chunk (data.stream_encode;
        text SFT); None: `encode` gets every sample at once."""
        return None

    def step_batches(self, model: torch.nn.Module, context: StepContext) -> list[Batch]:
        """This rank's micro-batches of the next optimizer step. By default the data
        position's; an online method (GRPO, GKD) samples its own from the prompts it draws
        (each `context.draw()`: one optimizer step's worth; the data position advances)."""
        return context.draw()

    def step_metrics(self) -> dict[str, float]:
        """Figures of the step besides the loss's metrics (a generation's rewards, lengths)."""
        return {}

    def evaluate(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        """(loss SUM, metric SUMS) of a validation micro-batch; by default the training loss.
        A method that generates (GRPO) scores sampled answers instead."""
        return self.loss(model, batch)

    def eval_normalizer(self, batch: Batch) -> float | torch.Tensor:
        """What `evaluate`'s sums of a validation micro-batch are divided by (summed over the
        validation set); by default the training normalizer. A method whose validation
        batches are prompts (GRPO, GKD) counts those."""
        return self.normalizer(batch)

    def pipeline_loss(self, logits: torch.Tensor, batch: Batch) -> LossOutput:
        """The loss from the last pipeline stage's logits (pipeline parallel only)."""
        raise ConfigError(
            f"--pipeline_parallel_size: {self.name} has no pipeline-parallel form; use "
            "--strategy ddp, fsdp2 or deepspeed"
        )

    def state_dict(self) -> dict | None:
        """State kept across steps (see `has_step_state`); None: nothing to keep."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict()` returned (called on resume when `has_step_state`)."""

    def close(self) -> None:
        """Release what the method started (a rollout engine's thread, reward workers)."""


# What every method class defines itself (the rest of `Method` may be set in `__init__`).
REQUIRED_MEMBERS = (
    "name",
    "to_sample",
    "encode",
    "length",
    "collate",
    "normalizer",
    "loss",
    "masked",
    "cache_options",
)


def missing_members(method_class: type) -> list[str]:
    """The members of `REQUIRED_MEMBERS` that `method_class` lacks."""
    return [m for m in REQUIRED_MEMBERS if not hasattr(method_class, m)]


def complete_method(method_class: type) -> type:
    """`method_class` checked and given the optional capabilities it lacks (`MethodDefaults`),
    so the rest of swiftlm calls them all unconditionally."""
    missing = missing_members(method_class)
    if missing:
        raise ConfigError(
            f"training method {method_class.__name__} lacks {', '.join(missing)}: define them "
            "(see swiftlm.methods.base.Method)"
        )
    if issubclass(method_class, MethodDefaults):
        return method_class
    # The class's own members come first in the MRO; the defaults fill the gaps only.
    namespace = {"__module__": method_class.__module__, "__doc__": method_class.__doc__}
    completed = type(method_class.__name__, (method_class, MethodDefaults), namespace)
    completed.__qualname__ = method_class.__qualname__
    return completed


# A method class (or any factory): built per run as `cls(cfg, tokenizer)`.
MethodBuilder = Callable[..., Method]
