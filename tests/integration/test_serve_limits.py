"""`swiftlm deploy`'s limits: hostile input, API keys, the queue bound, client disconnects and
the per-request timeout. A slow fake engine (`SlowEngine`) makes queues and timing visible."""

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import ServerThread, SlowEngine, app_routes  # noqa: E402

from swiftlm.serve.app import ServerSettings, generation_app  # noqa: E402
from swiftlm.serve.translate import ServedModels  # noqa: E402

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def chat(**changes) -> dict:
    return {**CHAT, **changes}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from swiftlm.engine.build import build_engine

    # float32: bfloat16 matmuls round differently by batch size, so a greedy answer could
    # change with what shares its batch; the isolation tests compare answers across batches.
    engine = build_engine(
        str(tiny_model_dir), max_num_seqs=4, max_model_len=256, torch_dtype="float32"
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    app = generation_app(engine, engine.tokenizer, ServedModels("tiny"), ServerSettings(max_n=4))
    with ServerThread(app) as url:
        yield url


def slow_app(tokenizer, **settings):
    engine = SlowEngine(token_id=tokenizer.convert_tokens_to_ids("a"), max_num_seqs=1)
    app = generation_app(engine, tokenizer, ServedModels("tiny"), ServerSettings(**settings))
    return app, engine


HOSTILE = [
    # (what, path, body as JSON or raw bytes, expected status)
    ("non-JSON body", "/v1/chat/completions", b"{not json", 400),
    ("empty body", "/v1/chat/completions", b"", 400),
    ("a JSON array", "/v1/chat/completions", b"[1, 2]", 400),
    ("messages not a list", "/v1/chat/completions", chat(messages="hi"), 400),
    ("no messages", "/v1/chat/completions", chat(messages=[]), 400),
    (
        "unknown role",
        "/v1/chat/completions",
        chat(messages=[{"role": "robot", "content": "x"}]),
        400,
    ),
    ("n a word", "/v1/chat/completions", chat(n="many"), 400),
    ("temperature a word", "/v1/chat/completions", chat(temperature="hot"), 400),
    ("huge n", "/v1/chat/completions", chat(n=10000), 400),
    ("n past 2**64", "/v1/chat/completions", chat(n=10**30), 400),
    ("negative max_tokens", "/v1/chat/completions", chat(max_tokens=-1), 400),
    ("zero max_tokens", "/v1/chat/completions", chat(max_tokens=0), 400),
    ("absurd top_p", "/v1/chat/completions", chat(top_p=5), 400),
    ("negative temperature", "/v1/chat/completions", chat(temperature=-1), 400),
    ("top_logprobs 50", "/v1/chat/completions", chat(logprobs=True, top_logprobs=50), 400),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=2), 400),
    ("100 stop strings", "/v1/chat/completions", chat(stop=[str(i) for i in range(100)]), 400),
    ("unknown field", "/v1/chat/completions", chat(max_token=5), 400),
    ("tools", "/v1/chat/completions", chat(tools=[{"type": "function"}]), 400),
    ("response_format", "/v1/chat/completions", chat(response_format={"type": "xml"}), 400),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-4"), 404),
    (
        "prompt past the context",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "word " * 2000}]),
        400,
    ),
    ("max_tokens past the context", "/v1/chat/completions", chat(max_tokens=100000), 400),
    (
        "10 MiB body",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "x" * (10 * 1024 * 1024)}]),
        413,
    ),
    ("completion echo", "/v1/completions", {"model": "tiny", "prompt": "x", "echo": True}, 400),
    ("empty prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, 400),
    (
        "token id past the vocabulary",
        "/v1/completions",
        {"model": "tiny", "prompt": [1, 10**6]},
        400,
    ),
    ("mixed prompt list", "/v1/completions", {"model": "tiny", "prompt": [1, "x"]}, 400),
    ("too many prompts", "/v1/completions", {"model": "tiny", "prompt": ["x"] * 5}, 400),
    ("stream a word", "/v1/chat/completions", chat(stream="yes"), 400),
    ("max_tokens a float", "/v1/chat/completions", chat(max_tokens=5.5), 400),
    ("seed past 64 bits", "/v1/chat/completions", chat(seed=2**80), 400),
    ("null content", "/v1/chat/completions", chat(messages=[{"role": "user"}]), 400),
    (
        "unpaired surrogate",  # json.dumps writes it as the escape \ud800
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "a\ud800"}]),
        400,
    ),
    ("surrogate in a prompt", "/v1/completions", {"model": "tiny", "prompt": "\udfff"}, 400),
    ("negative logprobs", "/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": -1}, 400),
    ("suffix", "/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400),
    ("unknown route", "/v1/embeddings", {"model": "tiny", "input": "x"}, 404),
]


@pytest.mark.bad_input(
    input="`swiftlm deploy`: malformed or hostile requests (non-JSON, wrong types, unknown "
    "fields or models, n=10000, max_tokens=-1, top_p=5, a 10 MiB body, a prompt past the "
    "context, a tool without a function, an unknown response_format type)",
    outcome="A 4xx with an OpenAI error object naming the field (400, 404 for an unknown model, "
    "413 for the body); never a 5xx; the server keeps answering",
)
def test_hostile_requests_get_4xx_openai_errors_and_the_server_keeps_working(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        for what, path, body, status in HOSTILE:
            check_refused(http, what, path, body, status)
        # 200 in all: the same cases again from 8 clients at once
        rounds = [case for _ in range(200 // len(HOSTILE)) for case in HOSTILE]
        spread = [rounds[i::8] for i in range(8)]
        failures: list = []
        threads = [
            threading.Thread(target=send_all, args=(server, part, failures)) for part in spread
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not failures, failures[:3]
        assert "max_token" in http.post("/v1/chat/completions", json=chat(max_token=5)).text
        refused = http.post("/v1/chat/completions", json=chat(logit_bias={"1": 5})).text
        assert "not supported" in refused
        ok = http.post("/v1/chat/completions", json=chat(user="ignored-by-design"))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        metrics = http.get("/metrics").text
    assert 'swiftlm_http_responses_total{status="5' not in metrics
    refusals = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('swiftlm_http_responses_total{status="4')
    ]
    assert sum(refusals) >= 200


def check_refused(http: httpx.Client, what: str, path: str, body, status: int) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == status, (what, reply.text[:300])
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, what
    assert error["message"], what


def send_all(url: str, cases: list, failures: list) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        for case in cases:
            try:
                check_refused(http, *case)
            except (AssertionError, httpx.HTTPError) as exc:
                failures.append(f"{case[0]}: {exc!r}")


@pytest.mark.bad_input(
    input="`swiftlm deploy --api_key K`: a request without `Authorization: Bearer K`, or with "
    "another key",
    outcome="401 with an OpenAI error object on every route but /health and the chat page /",
)
def test_every_route_but_health_and_the_page_needs_a_key(tiny_tokenizer):
    app, engine = slow_app(tiny_tokenizer, api_keys=("key-one", "key-two"))
    routes = app_routes(app)
    assert {"/v1/models", "/v1/chat/completions", "/metrics", "/health", "/"} <= {
        p for p, _ in routes
    }
    with ServerThread(app) as url, httpx.Client(base_url=url) as http:
        for path, method in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-two"}):
                reply = http.request(method, path, headers=headers)
                # Public on purpose: /health for probes; / is the chat page, which holds no
                # secret and asks for the key itself (a browser opening it sends no header).
                if path in ("/health", "/"):
                    assert reply.status_code == 200
                else:
                    assert reply.status_code == 401, (path, headers)
                    assert reply.json()["error"]["type"] == "authentication_error"
            reply = http.request(method, path, headers={"Authorization": "Bearer key-two"})
            assert reply.status_code in (200, 400), path  # 400: a POST without a body
    engine.shutdown()


@pytest.mark.bad_input(
    input="`swiftlm deploy`: more requests than --max_queued_requests waiting for a slot",
    outcome="429 with a Retry-After header and an OpenAI error (code queue_full)",
)
def test_a_full_queue_answers_429_with_retry_after(tiny_tokenizer):
    app, engine = slow_app(tiny_tokenizer, max_queued_requests=1)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream(
            "POST", "/v1/chat/completions", json=chat(max_tokens=200, stream=True)
        ) as first:
            assert first.status_code == 200
            next(first.iter_lines())
            queued = {}
            thread = threading.Thread(
                target=lambda: queued.update(r=http.post("/v1/chat/completions", json=chat()))
            )
            thread.start()
            wait_until(lambda: engine.stats().waiting == 1)
            refused = http.post("/v1/chat/completions", json=chat())
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
        thread.join(timeout=10)  # leaving the stream freed the slot for the queued request
        assert queued["r"].status_code == 200
    engine.shutdown()


def test_a_client_that_disconnects_frees_its_slot_within_2_s(tiny_tokenizer):
    app, engine = slow_app(tiny_tokenizer)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream(
            "POST", "/v1/chat/completions", json=chat(max_tokens=200, stream=True)
        ) as reply:
            assert reply.status_code == 200
            next(reply.iter_lines())
            assert running(http) == 1
        left = time.monotonic()
        wait_until(lambda: running(http) == 0, timeout=2)
        assert time.monotonic() - left < 2 and len(engine.aborted_ids) == 1
        # A non-streamed request whose client gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=chat(max_tokens=200), timeout=0.3)
        wait_until(lambda: len(engine.aborted_ids) == 2, timeout=2)
    engine.shutdown()


@pytest.mark.bad_input(
    input="`swiftlm deploy --request_timeout S`: a request that runs longer than S seconds",
    outcome="Aborted in the engine; answered 504 (code request_timeout), or in a stream an "
    "error event followed by data: [DONE]",
)
def test_a_request_past_the_timeout_is_aborted(tiny_tokenizer):
    app, engine = slow_app(tiny_tokenizer, request_timeout=0.4)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post("/v1/chat/completions", json=chat(max_tokens=200))
        assert reply.status_code == 504
        assert reply.json()["error"]["code"] == "request_timeout"
        events = http.post("/v1/chat/completions", json=chat(max_tokens=200, stream=True)).text
        data = [line[6:] for line in events.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "request_timeout"
        wait_until(lambda: len(engine.aborted_ids) == 2, timeout=2)
    engine.shutdown()


def running(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("swiftlm_running_sequences "):
            return float(line.split()[1])
    raise AssertionError("no swiftlm_running_sequences in /metrics")


def wait_until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


class BrokenEngine(SlowEngine):
    """Raises an unexpected error on the first submit only."""

    broken = True

    def submit(self, request, on_delta):
        if self.broken:
            self.broken = False
            raise KeyError("engine bug")
        super().submit(request, on_delta)


def test_a_server_bug_is_a_500_openai_error_and_the_worker_survives(tiny_tokenizer):
    engine = BrokenEngine(token_id=5, delay=0.01)
    app = generation_app(engine, tiny_tokenizer, ServedModels("tiny"), ServerSettings())
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post("/v1/chat/completions", json=chat())
        assert reply.status_code == 500
        assert reply.json()["error"]["type"] == "server_error"
        assert "engine bug" not in reply.text  # no internals in the answer
        assert http.post("/v1/chat/completions", json=chat()).status_code == 200
    engine.shutdown()


def test_32_concurrent_streams_all_end_with_done(server):
    import asyncio

    async def one(http: httpx.AsyncClient, i: int) -> list[str]:
        body = chat(max_tokens=16, stream=True, seed=i, temperature=1.0)
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            return [line async for line in reply.aiter_lines() if line]

    async def all_of_them() -> list[list[str]]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    streams = asyncio.run(all_of_them())
    assert all(lines[-1] == "data: [DONE]" for lines in streams)
    finishes = [json.loads(lines[-2][6:])["choices"][0]["finish_reason"] for lines in streams]
    assert set(finishes) <= {"stop", "length"}


def poison(monkeypatch, exc: Exception) -> None:
    """Make every sample of a prompt that says POISON fail inside the engine at its 3rd token."""
    from swiftlm.engine import scheduler

    accept = scheduler.Sequence.accept

    def failing_accept(seq, token, logprob):
        prompt = seq.detokenizer.tokenizer.decode(seq.row.prompt_ids)
        if "POISON" in prompt and len(seq.row.output_ids) == 2:
            raise exc
        return accept(seq, token, logprob)

    monkeypatch.setattr(scheduler.Sequence, "accept", failing_accept)


def test_a_sample_that_fails_in_the_engine_fails_only_its_request(server, monkeypatch, caplog):
    from swiftlm.engine.protocol import InvalidRequest

    greedy = chat(max_tokens=24, temperature=0, ignore_eos=True)
    bad = chat(max_tokens=24, messages=[{"role": "user", "content": "POISON"}], ignore_eos=True)
    with httpx.Client(base_url=server, timeout=60) as http:
        before = http.post("/v1/chat/completions", json=greedy).json()
        poison(monkeypatch, RuntimeError("a bug in detokenizing"))
        results: dict = {}
        normal = threading.Thread(
            target=lambda: results.update(normal=http.post("/v1/chat/completions", json=greedy))
        )
        normal.start()
        with caplog.at_level("ERROR", logger="swiftlm.engine.scheduler"):
            whole = http.post("/v1/chat/completions", json=bad)
            streamed = http.post("/v1/chat/completions", json={**bad, "stream": True}).text
        normal.join()
        assert results["normal"].json()["choices"] == before["choices"]
        # Not the client's mistake: a 500 whose error id is the one the server log holds.
        error = whole.json()["error"]
        assert whole.status_code == 500 and error["type"] == "server_error"
        error_id = error["message"].split("error id ")[1].split(",")[0]
        logged = [r.getMessage() for r in caplog.records if r.exc_info]
        assert any(f"error id {error_id}" in m for m in logged), logged
        assert "a bug in detokenizing" not in whole.text  # no internals in the answer
        # Streamed: the tokens before it, then an error event, then [DONE].
        events = [line[6:] for line in streamed.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == (
            "internal_error"
        )
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
        # A failure the request's own values caused is the client's: 400.
        poison(monkeypatch, InvalidRequest("seed 7: not a seed this engine takes"))
        refused = http.post("/v1/chat/completions", json=bad)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "seed 7: not a seed this engine takes"
        monkeypatch.undo()
        assert (
            http.post("/v1/chat/completions", json=greedy).json()["choices"] == (before["choices"])
        )
