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
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

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

    Optional: `model_kind`, what the model is loaded as (models.loader: "causal_lm" when
    absent; "sequence_classification" for a reward model, methods/reward_model.py).
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

    def prepare_model(self, model: torch.nn.Module, log: Callable[[str], None]) -> None:
        """Adjust the loaded, tuned model before any wrapper sees it (e.g. install the fused
        LM head; later: keep a reference model)."""
        ...

    def normalizer(self, batch: Batch) -> float:
        """Units `loss` sums over in this micro-batch (label tokens, pairs, weights ...),
        read from the batch alone: the loop needs it before the forward pass."""
        ...

    def loss(self, model: torch.nn.Module, batch: Batch) -> LossOutput:
        """(loss SUM over the micro-batch, metric SUMS) for the (wrapped) model."""
        ...

    def pipeline_loss(self, logits: torch.Tensor, batch: Batch) -> LossOutput:
        """The same loss from the last pipeline stage's logits (pipeline parallel only).

        A method without a pipeline form raises a ConfigError naming
        --pipeline_parallel_size."""
        ...

    def masked(self, sample: dict) -> dict:
        """A copy of an encoded sample that adds nothing to the loss or the normalizer: a
        data-parallel rank with no sample left runs it to keep collectives in step."""
        ...

    def cache_options(self) -> dict[str, Any]:
        """Everything besides the files and the tokenizer that the encoded samples depend on
        (the cache key)."""
        ...


# A method class (or any factory): built per run as `cls(cfg, tokenizer)`.
MethodBuilder = Callable[..., Method]
