"""Multi-LoRA serving: rows of two adapters and of the base model share one batch, unmerged,
and each gets the greedy tokens of its own model (a merged copy) run alone."""

import copy

import pytest
import torch

from conftest import build_tokenizer, make_tiny_llama
from swiftlm.engine.build import load_named_adapters
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 30)), [100, 101, 102, 103, 104]]


def save_random_lora(base, folder, seed: int) -> None:
    """A LoRA adapter with random (non-zero) B, so it visibly changes the model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(copy.deepcopy(base), config).save_pretrained(folder)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi-lora")
    tokenizer = build_tokenizer(root)
    base = make_tiny_llama(len(tokenizer)).eval()
    folders = {name: root / name for name in ("a", "b")}
    for seed, folder in enumerate(folders.values()):
        save_random_lora(base, folder, seed)
    model = load_named_adapters(copy.deepcopy(base), {k: str(v) for k, v in folders.items()})
    engine = ContinuousEngine(model, tokenizer, stop_token_ids=[2], adapters=("a", "b"))
    yield engine, base, folders
    engine.shutdown()


def merged(base, folder):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval()


def greedy(model, prompt):
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    return output[0, len(prompt) :].tolist()


def test_adapters_and_base_share_a_batch(served):
    engine, base, folders = served
    adapters = [None, "a", "b", "a", None, "b"]
    prompts = [PROMPTS[i % 3] for i in range(len(adapters))]
    requests = [
        GenerationRequest(p, GREEDY, adapter=a) for p, a in zip(prompts, adapters, strict=True)
    ]
    results = engine.generate(requests)
    models = {None: base, **{name: merged(base, folder) for name, folder in folders.items()}}
    expected = [greedy(models[a], p) for p, a in zip(prompts, adapters, strict=True)]
    assert [r[0].token_ids for r in results] == expected
    assert expected[0] != greedy(models["a"], prompts[0])  # the adapters change the answer
