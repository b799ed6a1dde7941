"""`--packed_weights`: linear layers whose bf16 weights oneDNN reordered once compute what the
loaded layers compute, for the plain model, a tied head and unmerged LoRA rows; DoRA layers
and peft's own A/B stay as loaded; where packing does not apply, auto leaves the model and
true refuses by name."""

import copy

import pytest
import torch
from torch import nn

from conftest import build_tokenizer, make_tiny_llama
from swiftlm.engine.build import (
    EngineOptions,
    build_engine,
    check_backend,
    load_named_adapters,
    pack_weights,
)
from swiftlm.engine.packed_weights import (
    PackedLinear,
    pack_linear_weights,
    parameter_count,
    why_not_packable,
)
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.errors import ConfigError
from tolerance import assert_close, forward_terms

VOCAB = 300
LINEARS = 2 * 7 + 1  # per layer q, k, v, o, gate, up, down; and the head


def bf16_llama(tie: bool = False):
    return make_tiny_llama(VOCAB, tie=tie).to(torch.bfloat16).eval()


needs_onednn_bf16 = pytest.mark.skipif(
    why_not_packable(nn.Linear(2, 2).to(torch.bfloat16)) is not None,
    reason=f"packing does not apply here: {why_not_packable(nn.Linear(2, 2).to(torch.bfloat16))}",
)


def head_magnitude(model, ids, **kwargs) -> float:
    """The largest sum of magnitudes behind one logit (|h| . |w| over the hidden size): the
    scale of the rounding of the head's products."""
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True, **kwargs).hidden_states[-1]
        head = model.get_output_embeddings().weight
        return (hidden.float().abs() @ head.float().abs().T).max().item()


def assert_same_logits(plain, packed, ids, **kwargs) -> None:
    with torch.inference_mode():
        want, got = plain(ids, **kwargs).logits, packed(ids, **kwargs).logits
    tokens = ids.shape[1]
    assert_close(
        got,
        want,
        terms=forward_terms(tokens, vocab=VOCAB),
        magnitude=head_magnitude(plain, ids, **kwargs),
        dtype=torch.bfloat16,
        what="packed logits",
    )


@needs_onednn_bf16
@pytest.mark.parametrize("tie", [False, True])
def test_packed_model_computes_the_loaded_models_logits(tie):
    plain = bf16_llama(tie)
    packed = copy.deepcopy(plain)
    count = parameter_count(plain)
    threads = torch.get_num_threads()
    assert pack_linear_weights(packed) == LINEARS
    assert torch.get_num_threads() == threads  # packed on one thread, then given back
    assert all(type(m) is not nn.Linear for m in packed.modules())
    assert parameter_count(packed) == count  # a tied head is counted once, as before
    assert packed.get_output_embeddings().out_features == VOCAB
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    assert_same_logits(plain, packed, ids)


def save_adapter(base, folder, seed: int, dora: bool = False) -> str:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        use_dora=dora,
    )  # fmt: skip
    get_peft_model(copy.deepcopy(base), config).save_pretrained(folder)
    return str(folder)


@needs_onednn_bf16
def test_unmerged_lora_rows_compute_the_same_logits_packed(tmp_path):
    base = make_tiny_llama(VOCAB).eval()
    folders = {name: save_adapter(base, tmp_path / name, seed) for seed, name in enumerate("ab")}
    plain = load_named_adapters(copy.deepcopy(base).to(torch.bfloat16), folders)
    packed = copy.deepcopy(plain)
    pack_linear_weights(packed)
    layer = packed.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, PackedLinear)  # the base layer is packed
    assert type(layer.lora_A["a"]) is nn.Linear  # peft reads A's and B's weights
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    assert_same_logits(plain, packed, ids, adapter_names=["a", "__base__", "b"])


@needs_onednn_bf16
def test_dora_layers_stay_as_loaded(tmp_path):
    base = make_tiny_llama(VOCAB).eval()
    folder = save_adapter(base, tmp_path / "dora", 0, dora=True)
    model = load_named_adapters(copy.deepcopy(base).to(torch.bfloat16), {"d": folder})
    packed = pack_linear_weights(model)
    attention = model.base_model.model.model.layers[0].self_attn
    assert type(attention.q_proj.base_layer) is nn.Linear  # DoRA reads the base weight
    assert isinstance(attention.k_proj, PackedLinear)
    assert packed == LINEARS - 2 * 2  # q and v of both layers kept


@pytest.mark.bad_input(
    input="`--packed_weights true` where packing does not apply (float32 or float16 weights, a GPU, a CPU without oneDNN bf16)",
    outcome="refused before serving, naming why and offering auto or false; auto leaves such a model as loaded",
)
def test_auto_leaves_what_it_cannot_pack_and_true_refuses():
    model = make_tiny_llama(VOCAB).eval()  # float32
    pack_weights(model, "auto")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ConfigError, match=r"--packed_weights true: the weights are float32.*auto"):
        pack_weights(model, "true")


@needs_onednn_bf16
def test_false_keeps_the_loaded_layers():
    model = bf16_llama()
    pack_weights(model, "false")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    pack_weights(model, "auto")
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == LINEARS


@pytest.mark.bad_input(
    input="`--packed_weights true` with `--infer_backend vllm` or a vision-language model",
    outcome="refused before anything loads, naming the backend or the model kind",
)
@pytest.mark.parametrize(
    ("backend", "vision", "named"),
    [("vllm", False, "--infer_backend vllm"), ("pt", True, "a vision-language model")],
)
def test_true_is_refused_outside_the_continuous_batching_engine(backend, vision, named):
    options = EngineOptions(infer_backend=backend, packed_weights="true")
    with pytest.raises(ConfigError, match=f"--packed_weights true: .*not for {named}"):
        check_backend(options, "some/model", vision)


@needs_onednn_bf16
def test_engine_serves_from_packed_weights(tmp_path):
    vocab = len(build_tokenizer(tmp_path))
    make_tiny_llama(vocab).save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = build_engine(str(tmp_path), torch_dtype="bfloat16", max_num_seqs=2)
    try:
        assert sum(isinstance(m, PackedLinear) for m in engine.model.modules()) == LINEARS
        assert engine.vocab_size == vocab
        [[result]] = engine.generate([GenerationRequest([5, 6, 7], params)])
        assert len(result.token_ids) == 6 and result.finish_reason == "length"
    finally:
        engine.shutdown()
