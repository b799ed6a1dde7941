"""Typed config sections of the commands that use a trained model: `swiftlm infer` (generation
and inference) and `swiftlm export`. Same conventions as `sections.py`: field names are the
flag names, each field's `help` is its `--help` text, each section checks its own fields.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import above, at_least, check_fields, custom, matching, within
from swiftlm.config.sections import doc

# `--max_shard_size` forms that transformers' save_pretrained parses.
SHARD_SIZE = r"\d+(GIB|MIB|KIB|GB|MB|KB)"


@dataclass
class GenerationArguments:
    max_new_tokens: int = doc("Most tokens generated per answer.", default=512)
    temperature: float = doc("Sampling temperature; 0 means greedy.", default=0.0)
    top_p: float = doc(
        "Nucleus sampling: smallest token set with this total probability.", default=1.0
    )
    top_k: int = doc("Sample among the k most likely tokens (0 disables).", default=0)
    repetition_penalty: float = doc("Penalty > 1 discourages repeating tokens.", default=1.0)

    def __post_init__(self):
        check_fields(
            self,
            max_new_tokens=at_least(1),
            temperature=custom(lambda v: v >= 0, "--{flag} {value} must be 0 (greedy) or more"),
            top_p=within(0, 1, open_low=True),
            top_k=custom(lambda v: v >= 0, "--{flag} {value} must be 0 (off) or more"),
            repetition_penalty=above(0),
        )


@dataclass
class InferArguments:
    task: Literal["generate", "score"] = doc(
        "generate: answer the prompts (chat, or --val_dataset in batch). score: write the "
        "reward of each --val_dataset conversation (it ends with the answer to score) as "
        "`score`, with a reward model (`swiftlm rlhf --rlhf_type rm`).",
        default="generate",
    )
    adapters: list[str] = doc(
        "LoRA/DoRA adapter folders to apply on --model (merged into it). `swiftlm deploy` "
        "takes name=path and serves each adapter, unmerged, as the model `name`.",
        default_factory=list,
    )
    ckpt_dir: str | None = doc(
        "A swiftlm run directory, its final/ folder or a checkpoint: the model (and base model) "
        "are read from the saved config.",
        default=None,
    )
    result_path: str | None = doc(
        "Batch mode: write one JSON line per --val_dataset sample here.", default=None
    )
    max_batch_size: int = doc(
        "Most sequences decoded together: the engine batches prompts continuously, a new "
        "one joining as soon as another finishes. Text models only: a vision-language model "
        "answers one prompt at a time (continuous batching is text-only).",
        default=32,
    )
    stream: bool = doc("Interactive mode: print tokens as they are generated.", default=True)
    images: list[str] = doc(
        "Chat mode with a vision-language model: images (local paths, http(s) or data URLs) "
        "of the first question. They fill its <image> tags in order; a question without tags "
        "gets them all in front of its text. In the chat, `/image PATH ...` attaches images "
        "to the next question the same way. Batch rows (--val_dataset) carry their own.",
        default_factory=list,
    )
    seed: int = doc("Seed for sampling.", default=42)

    def __post_init__(self):
        check_fields(self, max_batch_size=at_least(1))


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

    def __post_init__(self):
        check_fields(
            self,
            max_shard_size=matching(
                SHARD_SIZE, "give a whole number and a unit, e.g. 5GB or 500MB"
            ),
        )
