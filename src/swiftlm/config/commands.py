"""Command configs: each is a composition of typed sections (see `sections.py`)."""

from dataclasses import dataclass, field

from swiftlm.config.sections import (
    DataArguments,
    DistArguments,
    ExportArguments,
    GenerationArguments,
    InferArguments,
    ModelArguments,
    OutputArguments,
    QuantArguments,
    TrainArguments,
    TunerArguments,
)


@dataclass
class TrainConfig:
    """`swiftlm sft` and `swiftlm pt`: everything a training run needs."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    tuner: TunerArguments = field(default_factory=TunerArguments)
    quant: QuantArguments = field(default_factory=QuantArguments)
    train: TrainArguments = field(default_factory=TrainArguments)
    output: OutputArguments = field(default_factory=OutputArguments)
    dist: DistArguments = field(default_factory=DistArguments)


@dataclass
class InferConfig:
    """`swiftlm infer`: a model (or run) to load, prompts and sampling settings."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    generation: GenerationArguments = field(default_factory=GenerationArguments)
    infer: InferArguments = field(default_factory=InferArguments)


@dataclass
class ExportConfig:
    """`swiftlm export`: a model (or run) to load and what to write."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    infer: InferArguments = field(default_factory=InferArguments)
    export: ExportArguments = field(default_factory=ExportArguments)
    quant: QuantArguments = field(default_factory=QuantArguments)
