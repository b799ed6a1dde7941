"""`swiftlm deploy`'s app on the real engine and a tiny model, called with the official
`openai` client: chat and completions, streamed and not, n, stop, logprobs, usage, adapters."""

import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import ServerThread  # noqa: E402

MESSAGES = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tiny_lora_run):
    from swiftlm.engine.build import build_engine

    adapters = {"my-run": str(tiny_lora_run / "final")}
    engine = build_engine(
        str(tiny_model_dir), adapters=adapters, max_num_seqs=8, max_model_len=256, seed=0
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    app = generation_app(
        engine, engine.tokenizer, ServedModels("tiny", ("my-run",)), ServerSettings()
    )
    with ServerThread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def chat_prompt_tokens(tokenizer) -> int:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_models_lists_the_base_model_and_each_adapter(client):
    assert [m.id for m in client.models.list().data] == ["tiny", "my-run"]


def test_chat_stream_joins_to_the_whole_answer_with_usage(client, engine):
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0
    )
    answer = whole.choices[0].message.content
    assert answer and whole.choices[0].finish_reason in ("stop", "length")
    usage = whole.usage
    assert usage.prompt_tokens == chat_prompt_tokens(engine.tokenizer)
    assert 1 <= usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == usage.model_dump()
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason


def test_completions_stream_joins_to_the_whole_answer(client):
    kwargs = dict(model="tiny", prompt="The capital of France", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == whole.choices[0].text
    assert whole.usage.completion_tokens >= 1
    assert whole.object == "text_completion"


def test_a_token_id_prompt_answers_as_its_text_does(client, engine):
    kwargs = dict(model="tiny", max_tokens=8, temperature=0)
    text = "The capital of France"
    ids = engine.tokenizer(text)["input_ids"]
    by_text = client.completions.create(prompt=text, **kwargs).choices[0].text
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == by_text
    both = client.completions.create(prompt=[ids, ids[:2]], **kwargs)
    assert both.choices[0].text == by_text and len(both.choices) == 2


def test_n_samples_and_several_prompts(client):
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, n=2, temperature=1.0, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1]
    tokens = client.completions.create(
        model="tiny", prompt=["Hello", "The quick brown fox"], max_tokens=4, n=2, seed=1
    )
    assert sorted(c.index for c in tokens.choices) == [0, 1, 2, 3]


def test_stop_string_cuts_the_answer_before_it(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=32, temperature=0)
    answer = client.chat.completions.create(**kwargs).choices[0].message.content
    start = next(
        i for i in range(1, len(answer) - 1) if answer[i : i + 2].isascii() and answer[i].isalpha()
    )
    stop = answer[start : start + 2]
    cut = client.chat.completions.create(**kwargs, stop=[stop, "never-seen"])
    assert cut.choices[0].message.content == answer[: answer.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs_report_the_chosen_token_and_alternatives(client):
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy picks the most likely token, so it heads the alternatives.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_completion_logprobs_have_tokens_offsets_and_alternatives(client):
    reply = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == reply.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_each_adapter_answers_as_its_own_model(client, server):
    kwargs = dict(messages=MESSAGES, max_tokens=12, temperature=0)
    base = client.chat.completions.create(model="tiny", **kwargs).choices[0].message.content
    tuned = client.chat.completions.create(model="my-run", **kwargs)
    assert tuned.model == "my-run"
    assert tuned.choices[0].message.content != base
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", **kwargs)
    assert info.value.body["code"] == "model_not_found"


def test_health_and_metrics(server, client):
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server}/metrics").text
    for name in (
        'swiftlm_requests_total{endpoint="chat",model="tiny"}',
        'swiftlm_generation_tokens_total{model="tiny"}',
        "swiftlm_queue_depth 0.0",
        "swiftlm_running_sequences",
        "swiftlm_time_to_first_token_seconds_bucket",
        "swiftlm_inter_token_latency_seconds_bucket",
        "swiftlm_e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name


def test_the_server_answers_as_swiftlm_infer_does(client, tiny_model_dir, tmp_path):
    from conftest import write_jsonl
    from swiftlm.cli.main import main

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": MESSAGES}])
    results = tmp_path / "results.jsonl"
    flags = ["--model", str(tiny_model_dir), "--val_dataset", str(prompts)]
    flags += ["--result_path", str(results), "--max_new_tokens", "24", "--temperature", "0"]
    assert main(["infer", *flags]) == 0
    offline = json.loads(results.read_text().splitlines()[0])["response"]
    served = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert served.choices[0].message.content == offline
