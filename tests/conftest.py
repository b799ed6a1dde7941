"""Shared fixtures: a tiny random Llama and a byte-level BPE tokenizer built in-process.

No test touches the network: the hub is switched off before anything imports transformers.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "Who are you? I am a helpful assistant made by the swiftlm team.",
    "What is the capital of France? The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog. 1 2 3 4 5 6 7 8 9 0",
    "Hello! How can I help you today? Tell me a story about a cat.",
    "你好，我是一个人工智能助手。请问有什么可以帮你？",
    "system user assistant tool answer question data model train loss",
]


def build_tokenizer(out_dir: Path, chat_template: str | None = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def make_tiny_llama(
    vocab_size: int,
    seed: int = 0,
    tie: bool = False,
    hidden_size: int = 64,
    initializer_range: float = 0.1,
):
    """A seeded 2-layer Llama (hidden 64 by default, MLP twice as wide, GQA 4/2 heads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
        # Wider than the default 0.02 so that logits can move far enough for a frozen-head
        # LoRA run to show a clear loss drop in a few steps.
        initializer_range=initializer_range,
    )
    return LlamaForCausalLM(config)


def build_tiny_llama(out_dir: Path, vocab_size: int, seed: int = 0, tie: bool = False):
    model = make_tiny_llama(vocab_size, seed, tie)
    model.save_pretrained(out_dir)
    return model


def make_tiny_moe(model_type: str, vocab_size: int, seed: int = 0):
    """A seeded 2-layer mixture-of-experts model, hidden 64, 8 experts of width 32, top 2:
    `qwen3_moe` (normalized top-k weights, q/k norms) or `mixtral` (sliding-window Mistral)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.1,
    )
    if model_type == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**shape, intermediate_size=32, num_local_experts=8))
    config = Qwen3MoeConfig(
        **shape, intermediate_size=128, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True
    )
    return Qwen3MoeForCausalLM(config)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A saved tiny Qwen3-MoE (make_tiny_moe) with the ChatML BPE tokenizer."""
    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tokenizer = build_tokenizer(out)
    make_tiny_moe("qwen3_moe", len(tokenizer)).save_pretrained(out)
    return out


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest on one thread, and 2-core CI machines are shared."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _private_data_cache(tmp_path_factory):
    """Tokenized-data cache entries of the tests stay out of the user's cache."""
    previous = os.environ.get("SWIFTLM_DATA_CACHE")
    os.environ["SWIFTLM_DATA_CACHE"] = str(tmp_path_factory.mktemp("data-cache"))
    yield
    if previous is None:
        os.environ.pop("SWIFTLM_DATA_CACHE")
    else:
        os.environ["SWIFTLM_DATA_CACHE"] = previous


@pytest.fixture(autouse=True)
def _warm_multi_rank_workers(request, monkeypatch):
    """In-process multi-rank runs fork their workers from a warm process (tests/warm_launch.py)
    unless the test is marked torchrun_subprocess."""
    if request.node.get_closest_marker("torchrun_subprocess"):
        return
    from warm_launch import in_process_agent

    monkeypatch.setattr("swiftlm.distributed.launch.call_forwarding_signals", in_process_agent)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama (2 layers, hidden 64) with a ChatML BPE tokenizer."""
    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer(out)
    build_tiny_llama(out, vocab_size=len(tokenizer))
    return out


def build_wide_tiny_llama(out_dir: Path, initializer_range: float = 0.1) -> Path:
    """The tiny Llama at hidden 128 (MLP 256) with the ChatML tokenizer: every layer width is a
    multiple of the quantizers' default group size, 128."""
    tokenizer = build_tokenizer(out_dir)
    model = make_tiny_llama(len(tokenizer), hidden_size=128, initializer_range=initializer_range)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def wide_tiny_model_dir(tmp_path_factory) -> Path:
    return build_wide_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"))


@pytest.fixture(scope="session")
def tiny_lora_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A 6-step LoRA run of the tiny Llama (run folder `my-run`), for the export tests. A high
    learning rate moves the logits far from the base model's, so a merge has something to
    reproduce."""
    root = tmp_path_factory.mktemp("lora-run")
    data = write_jsonl(root / "chat.jsonl", CHAT_ROWS)
    flags = dict(max_steps=6, learning_rate=5e-2, lora_dropout=0, save_steps=100)
    from swiftlm.cli.main import main

    assert main(tiny_sft(tiny_model_dir, data, root / "my-run", **flags)) == 0
    return root / "my-run"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


CHAT_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Question number {i}?"},
            {"role": "assistant", "content": f"Answer number {i} is {i * 7}."},
        ]
    }
    for i in range(24)
]


@pytest.fixture
def chat_jsonl(tmp_path) -> Path:
    """24 short valid conversations."""
    return write_jsonl(tmp_path / "chat.jsonl", CHAT_ROWS)


def logged(run_dir: Path, key: str = "loss") -> list:
    """The values of `key` in a run's metrics.jsonl, in order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


def max_weight_difference(file_a: Path, file_b: Path) -> float:
    """Largest absolute difference between two safetensors files with the same tensors."""
    from safetensors.torch import load_file

    a, b = load_file(file_a), load_file(file_b)
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def stopped_at(run_dir: Path, step: int, copy_to: Path) -> Path:
    """A copy of a finished run as if it had stopped right after saving checkpoint `step`."""
    import shutil

    shutil.copytree(run_dir, copy_to)
    shutil.rmtree(copy_to / "final")
    for folder in (copy_to / "checkpoints").glob("step-*"):
        if int(folder.name[5:]) > step:
            shutil.rmtree(folder)
    rows = (copy_to / "metrics.jsonl").read_text().splitlines()
    kept = [row for row in rows if json.loads(row)["step"] <= step]
    (copy_to / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    return copy_to


def tiny_sft(model_dir: Path, data: Path, out: Path, **flags) -> list:
    """`swiftlm sft` arguments for a tiny-model run: fp32, no TensorBoard, a log line per
    step, unless `flags` say otherwise; then `flags` as `--name value` (a list: several values).
    Each flag appears once: a repeated scalar flag is an error, a repeated list flag adds."""
    defaults = {"torch_dtype": "float32", "report_to": "none", "logging_steps": 1}
    argv = ["sft", "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    for name, value in {**defaults, **flags}.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        argv += [f"--{name}", *map(str, values)]
    return argv


def text_corpus(path: Path, documents: int = 200, seed: int = 5) -> Path:
    """A JSONL pre-training corpus of seeded word salad (some non-ASCII), one document a row."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "stream", "token", "résumé", "東京"]
    with path.open("w") as f:
        for i in range(documents):
            text = f"doc {i}: " + " ".join(rng.choices(words, k=rng.randint(2, 60)))
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def run_pt(model_dir, data, out, **flags) -> list:
    """`swiftlm pt` on the tiny model (6 steps of 2 chunks of 48 tokens, fp32); its losses."""
    from swiftlm.cli.main import main

    defaults = dict(torch_dtype="float32", report_to="none", logging_steps=1, max_length=48)
    defaults.update(per_device_train_batch_size=2, max_steps=6, learning_rate=5e-3, seed=7)
    argv = ["pt", "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    for name, value in {**defaults, **flags}.items():
        argv += [f"--{name}", str(value)]
    assert main(argv) == 0
    return logged(out)
