"""The config section of `swiftlm export`: the format, where it goes, shards and the
checks run on what was written. Same conventions as `config/sections.py`: field names are
the flag names, each field's `help` is its `--help` text, the section checks its own fields.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import check_fields, matching, within
from swiftlm.config.sections import doc

# `--max_shard_size` forms that transformers' save_pretrained parses.
SHARD_SIZE = r"\d+(GIB|MIB|KIB|GB|MB|KB)"


@dataclass
class ExportArguments:
    output_dir: str | None = doc("Folder to write the exported model to (required).", default=None)
    merge_lora: bool = doc(
        "Merge the LoRA/DoRA adapters into the base weights and save a full Hugging Face "
        "folder (safetensors, tokenizer and chat template included). The other formats merge "
        "adapters first on their own.",
        default=False,
    )
    max_shard_size: str = doc("Largest safetensors shard, e.g. 5GB or 500MB.", default="5GB")
    to_gguf: bool = doc(
        "Write one GGUF file for llama.cpp and Ollama (tokenizer and chat template embedded).",
        default=False,
    )
    gguf_type: Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"] = doc(
        "GGUF tensor type for --to_gguf: f32, f16, bf16, or llama.cpp's block quantizations "
        "q8_0, q5_0, q5_1, q4_0, q4_1 (norms and biases stay f32).",
        default="f16",
    )
    to_ollama: bool = doc(
        "Also write an Ollama Modelfile next to the GGUF file (implies --to_gguf).",
        default=False,
    )
    to_onnx: bool = doc(
        "Export to ONNX through torch's exporter (needs the onnx extra), checked with onnxruntime.",
        default=False,
    )
    merge_models: list[str] = doc(
        "Merge these fine-tunes of --model into one model (full model folders, LoRA/DoRA "
        "adapter folders over --model, or swiftlm run directories), by --merge_method.",
        default_factory=list,
    )
    merge_method: Literal[
        "linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "slerp"
    ] = doc(
        "How --merge_models are combined. linear: the weighted mean of the models; "
        "task_arithmetic: --model + the weighted sum of each model's difference from it (its "
        "task vector); ties: task vectors trimmed to their largest --merge_density share, one "
        "sign elected per weight, the agreeing values averaged; dare_linear / dare_ties: task "
        "vectors randomly dropped to --merge_density and rescaled, then summed or TIES-merged; "
        "slerp: spherical interpolation of two models at --merge_t.",
        default="linear",
    )
    merge_weights: list[float] | None = doc(
        "One weight per --merge_models entry (default: equal weights summing to 1).",
        default=None,
    )
    merge_density: float = doc(
        "ties, dare_linear, dare_ties: the share of each task vector's values kept.",
        default=0.5,
    )
    merge_t: float = doc(
        "slerp: 0 gives the first model, 1 the second.",
        default=0.5,
    )
    merge_seed: int = doc(
        "dare_linear, dare_ties: the seed of the random drops (the same seed, the same merge).",
        default=0,
    )

    def __post_init__(self):
        check_fields(
            self,
            max_shard_size=matching(
                SHARD_SIZE, "give a whole number and a unit, e.g. 5GB or 500MB"
            ),
            merge_density=within(0, 1, open_low=True),
            merge_t=within(0, 1),
        )
