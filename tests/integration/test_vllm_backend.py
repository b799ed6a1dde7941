"""`--infer_backend vllm`: vLLM's engine behind swiftlm's `Engine` protocol, checked against
swiftlm's own engine on the same float32 model and requests.

Greedy tokens must be equal and log-probs agree to float32 arithmetic (both engines compute
the same 2-layer forward; kernels differ in summation order: ~1e-6 relative on logits of
magnitude ~10, so 1e-4 absolute on a log-prob is far above rounding and far below any real
difference).

These run where vLLM installs: `bash scripts/setup_vllm.sh`, then
`.venv-vllm/bin/python -m pytest -m vllm` (.ci/run does both).
"""

import json
import os

import pytest

from swiftlm.engine.build import build_engine
from swiftlm.engine.grammar import Grammars
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.engine.vllm_backend import VllmOptions, build_vllm_engine
from vllm_helpers import VLLM_ENV, VLLM_MISSING, build_vllm_model

pytest.importorskip("vllm", reason=VLLM_MISSING)
pytestmark = pytest.mark.vllm
LOGPROB_ATOL = 1e-4
TEXTS = [
    "Hello, how are you today?",
    "Name three colors.",
    "Write a long answer about the history of the world, the sea and the mountains. " * 2,
    "yes yes yes yes yes yes",
]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    folder, adapter = tmp_path_factory.mktemp("vllm_model"), tmp_path_factory.mktemp("lora")
    tokenizer = build_vllm_model(folder, adapter)
    return folder, adapter, [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def prompts(vllm_model):
    return vllm_model[2]


@pytest.fixture(scope="module")
def engines(vllm_model):
    """(swiftlm's engine, vLLM's), both float32, both serving the adapter as "a"."""
    os.environ.update(VLLM_ENV)
    folder, adapter, _ = vllm_model
    options = dict(torch_dtype="float32", max_num_seqs=8, max_model_len=256, seed=0)
    ours = build_engine(str(folder), adapters={"a": str(adapter)}, warmup=False, **options)
    theirs = build_vllm_engine(
        str(folder),
        tokenizer_path=str(folder),
        adapters={"a": str(adapter)},
        options=VllmOptions(enforce_eager=True),
        **options,
    )
    yield ours, theirs
    ours.shutdown()
    theirs.shutdown()


def _both(engines, requests):
    ours, theirs = engines
    return ours.generate(requests), theirs.generate(requests)


def _greedy(max_tokens=12, **fields):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


@pytest.mark.parametrize("adapter", [None, "a"])
def test_greedy_tokens_and_logprobs_equal_swiftlm_s_engine(engines, prompts, adapter):
    params = _greedy(logprobs=True, top_logprobs=3)
    requests = [GenerationRequest(p, params, adapter=adapter) for p in prompts]
    ours, theirs = _both(engines, requests)
    for mine, vllm_samples in zip(ours, theirs, strict=True):
        a, b = mine[0], vllm_samples[0]
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "length"
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < LOGPROB_ATOL
            assert [i for i, _ in y.top] == [i for i, _ in x.top]
            for (_, lx), (_, ly) in zip(x.top, y.top, strict=True):
                assert abs(lx - ly) < LOGPROB_ATOL


def test_base_and_adapter_rows_batched_together_keep_their_own_weights(engines, prompts):
    """A base-model request beside an adapter request in one batch answers as the base model
    (vLLM's CPU LoRA ops read a base row's slot -1 as the last adapter's: swiftlm keeps that
    slot empty), and the adapter answers differently: the adapter test above cannot pass by
    ignoring the adapter."""
    ours, theirs = engines
    base, adapted = (GenerationRequest(prompts[0], _greedy(), adapter) for adapter in (None, "a"))
    alone = ours.generate([base, adapted])
    mixed = theirs.generate([base, adapted])
    assert [m[0].token_ids for m in mixed] == [a[0].token_ids for a in alone]
    assert mixed[0][0].token_ids != mixed[1][0].token_ids


def test_n_seeded_samples_are_reproducible_and_distinct(engines, prompts):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=4, ignore_eos=True)
    first = engines[1].generate([GenerationRequest(prompts[1], params)])[0]
    again = engines[1].generate([GenerationRequest(prompts[1], params)])[0]
    assert [s.index for s in first] == [0, 1, 2, 3]
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert len({tuple(s.token_ids) for s in first}) > 1


def test_stop_tokens_and_stop_strings_end_the_sample(engines, prompts):
    ours, theirs = engines
    free = ours.generate([GenerationRequest(prompts[0], _greedy(16))])[0][0]
    stop_at = free.token_ids[4]
    stop_text = ours.tokenizer.decode(free.token_ids[6:8])
    params = [_greedy(16, stop_token_ids=(stop_at,)), _greedy(16, stop=(stop_text,))]
    requests = [GenerationRequest(prompts[0], p) for p in params]
    for mine, vllm_samples in zip(*_both(engines, requests), strict=True):
        assert vllm_samples[0].finish_reason == mine[0].finish_reason == "stop"
        assert vllm_samples[0].token_ids == mine[0].token_ids
    assert theirs.generate([requests[0]])[0][0].token_ids[-1] == stop_at


def test_a_json_schema_grammar_is_enforced_by_vllm(engines, prompts):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    theirs = engines[1]
    grammar = Grammars(theirs.tokenizer, theirs.stop_token_ids).json_schema(schema)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=3)
    samples = theirs.generate([GenerationRequest(prompts[2], params, constraint=grammar)])[0]
    for sample in samples:
        assert sample.finish_reason == "stop", sample.text
        value = json.loads(sample.text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


def test_prefix_hits_are_counted(engines):
    theirs = engines[1]
    shared = list(range(60, 200))  # one of vLLM's 128-token CPU blocks, and some
    theirs.generate([GenerationRequest(shared + [1], _greedy(2))])
    before = theirs.stats()
    theirs.generate([GenerationRequest(shared + [i], _greedy(2)) for i in (2, 3)])
    after = theirs.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 2 * 128
    assert after.prefill_tokens - before.prefill_tokens == 2 * (len(shared) + 1 - 128)
    assert after.running == after.waiting == 0


def test_bad_requests_are_refused_by_name(engines, prompts):
    theirs = engines[1]
    with pytest.raises(ValueError, match="adapter 'b': not served"):
        theirs.validate(GenerationRequest(prompts[0], _greedy(), adapter="b"))
    with pytest.raises(ValueError, match="exceed the context length max_model_len 256"):
        theirs.validate(GenerationRequest(prompts[0], _greedy(300)))
    scaled = SamplingParams(max_tokens=8, logprobs=True, logprobs_mode="scaled")
    with pytest.raises(ValueError, match="logprobs_mode scaled: this vLLM engine reports raw"):
        theirs.validate(GenerationRequest(prompts[0], scaled))


def test_abort_ends_the_sample_with_abort(engines, prompts):
    import threading

    theirs = engines[1]
    request = GenerationRequest(prompts[0], _greedy(200))
    deltas, done = [], threading.Event()

    def collect(delta):
        deltas.append(delta)
        if delta.finish_reason:
            done.set()
        elif len(deltas) == 3:
            theirs.abort(request.request_id)

    theirs.submit(request, collect)
    assert done.wait(60)
    assert deltas[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in deltas) < 200
