"""The config section of what a command that uses a trained model loads and runs
(`InferArguments`: the run or adapters to load, the task, batch size, prompts' images,
where answers go), read by infer and, in part, by eval, export and deploy. Same conventions
as `config/sections.py`: field names are the flag names, each field's `help` is its `--help`
text, the section checks its own fields when built.
"""

from dataclasses import dataclass
from typing import Literal

from swiftlm.config.checks import at_least, check_fields, within
from swiftlm.config.sections import doc


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
    prefix_cache_memory: int = doc(
        "MiB of keys and values of prompt prefixes the engine keeps across requests (prefix "
        "caching): a prompt that starts like an earlier one (a chat resending its history, a "
        "shared system prompt or few-shot header) prefills only the rest. Least recently used "
        "blocks go first beyond it; 0 turns it off. Text models only.",
        default=256,
    )
    speculative_tokens: int = doc(
        "Speculative decoding by prompt lookup: up to this many draft tokens per step, copied "
        "from where the answer's last few tokens occur earlier in its prompt or output, all "
        "checked in one forward; the answer is the one plain decoding gives (sampling "
        "included). Used while at most 4 answers decode together. Pays where answers quote "
        "their prompt (editing, summaries, retrieval, code): 2-3x tokens/s on one stream "
        "there, 0.9-1.1x on plain chat (docs/benchmarks.md). 0 turns it off. Text models only.",
        default=0,
    )

    packed_weights: Literal["auto", "true", "false"] = doc(
        "pt engine, bf16 on a CPU: reorder each linear layer's weight once at load into "
        "oneDNN's blocked layout, so no product reorders it again (vLLM's CPU build does the "
        "same): the same numbers, 1.2-1.3x decode tokens/s (docs/benchmarks.md). The weights "
        "then serve only inference. auto: where it applies (bf16 weights on a CPU whose "
        "oneDNN has bf16; DoRA layers stay as loaded); true: refuse where it does not; false: "
        "keep transformers' layers as loaded. Text models only.",
        default="auto",
    )
    infer_backend: Literal["pt", "vllm", "sglang"] = doc(
        "The generation engine. pt: swiftlm's own (continuous batching on the transformers "
        "model; CPU or GPU, named adapters unmerged, log-probs equal to the trainer's). vllm: "
        "vLLM's engine behind the same front ends (paged attention, CUDA graphs, tensor "
        "parallel; `pip install 'swiftlm[vllm]'`, or on a CPU `bash scripts/setup_vllm.sh`). "
        "sglang is ms-swift's third choice and is not built yet. Text models only.",
        default="pt",
    )
    vllm_gpu_memory_utilization: float = doc(
        "--infer_backend vllm on a GPU: the share of its memory vLLM may take (weights and "
        "KV cache). On a CPU vLLM reads VLLM_CPU_KVCACHE_SPACE (GiB) instead.",
        default=0.9,
    )
    vllm_tensor_parallel_size: int = doc(
        "--infer_backend vllm: GPUs one model is split over (tensor parallel).", default=1
    )
    vllm_enforce_eager: bool = doc(
        "--infer_backend vllm: run eagerly, without torch.compile or CUDA graphs: starts in "
        "seconds instead of minutes, decodes slower.",
        default=False,
    )

    def __post_init__(self):
        check_fields(
            self,
            max_batch_size=at_least(1),
            prefix_cache_memory=at_least(0),
            speculative_tokens=at_least(0),
            vllm_tensor_parallel_size=at_least(1),
            vllm_gpu_memory_utilization=within(0, 1, open_low=True),
        )
