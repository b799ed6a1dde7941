"""Constrained decoding on the continuous-batching engine: a tiny model with random weights,
sampled at temperature 1, still writes JSON that parses and validates, because the grammar
masks every row's logits before sampling."""

import json

import pytest

from conftest import build_tokenizer, make_tiny_llama
from swiftlm.engine.continuous import ContinuousEngine
from swiftlm.engine.protocol import GenerationRequest, SamplingParams

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from swiftlm.engine.grammar import Grammars  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        # Bounded by a pattern, not maxLength: xgrammar 0.2.9 compiles maxLength strings to a
        # rule that lets control characters through (json.loads refuses those).
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("grammar-tokenizer"))
    model = make_tiny_llama(len(tokenizer)).eval()
    engine = ContinuousEngine(model, tokenizer, stop_token_ids=[2], max_num_seqs=8)
    yield engine, Grammars(tokenizer, [2])
    engine.shutdown()


def test_json_schema_outputs_validate_at_temperature_one(setup):
    engine, grammars = setup
    constraint = grammars.json_schema(PERSON)
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, n=4)
    requests = [GenerationRequest([5, 6, 7 + i], params, constraint=constraint) for i in range(5)]
    samples = [s for per_request in engine.generate(requests) for s in per_request]
    assert len(samples) == 20
    for sample in samples:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), PERSON)


def test_json_object_outputs_parse_and_unconstrained_rows_share_the_batch(setup):
    engine, grammars = setup
    constrained = SamplingParams(max_tokens=200, temperature=1.0, seed=3, n=4)
    free = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    requests = [
        GenerationRequest([9, 10, 11], constrained, constraint=grammars.json_object()),
        GenerationRequest([9, 10, 11], free),
    ]
    json_samples, (free_sample,) = engine.generate(requests)
    finished = [s for s in json_samples if s.finish_reason == "stop"]
    assert finished, [s.text for s in json_samples]
    for sample in finished:
        assert isinstance(json.loads(sample.text), dict)
    assert len(free_sample.token_ids) == 20  # the free row is not masked
