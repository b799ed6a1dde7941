"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own so that several
apps (tests) can live in one process. Every server counts its responses by status (the gate
calls `count_response`); a generating model adds its requests, tokens and latencies, a reward
model the conversations and tokens it scored."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from swiftlm.engine.protocol import Engine, SampleDelta

# Seconds; from a fast GPU's first token to a slow CPU's long answer.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """What every server exports: its responses by status code."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.responses = Counter(
            "swiftlm_http_responses",
            "HTTP responses by status code.",
            ["status"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_response(self, status: int) -> None:
        self.responses.labels(str(status)).inc()


class GenerationMetrics(ServerMetrics):
    def __init__(self, engine: Engine):
        super().__init__()
        r = self.registry
        self.requests = Counter(
            "swiftlm_requests", "Generation requests admitted.", ["model", "endpoint"], registry=r
        )
        self.prompt_tokens = Counter(
            "swiftlm_prompt_tokens", "Prompt tokens of admitted requests.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "swiftlm_generation_tokens", "Tokens generated.", ["model"], registry=r
        )
        queue = Gauge("swiftlm_queue_depth", "Requests waiting for a batch slot.", registry=r)
        queue.set_function(lambda: engine.stats().waiting)
        running = Gauge("swiftlm_running_sequences", "Sequences decoding now.", registry=r)
        running.set_function(lambda: engine.stats().running)
        r.register(EngineCounters(engine))
        self.time_to_first_token = self._histogram(
            "swiftlm_time_to_first_token_seconds", "From admission to a sample's first token."
        )
        self.inter_token_latency = self._histogram(
            "swiftlm_inter_token_latency_seconds", "Between consecutive tokens of a sample."
        )
        self.request_latency = self._histogram(
            "swiftlm_e2e_request_latency_seconds", "From admission to the last token."
        )

    def _histogram(self, name: str, text: str) -> Histogram:
        return Histogram(name, text, ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def track(self, model: str, endpoint: str, prompt_tokens: int) -> "RequestTimer":
        self.requests.labels(model, endpoint).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        return RequestTimer(self, model)


class RequestTimer:
    """Times one request's samples as their deltas arrive."""

    def __init__(self, metrics: GenerationMetrics, model: str):
        self.metrics = metrics
        self.model = model
        self.start = time.perf_counter()
        self.last_token_at: dict[int, float] = {}  # choice index -> when its last token came

    def observe(self, choice: int, delta: SampleDelta) -> None:
        now = time.perf_counter()
        count = len(delta.token_ids)
        if count:
            self.metrics.generation_tokens.labels(self.model).inc(count)
            previous = self.last_token_at.get(choice)
            if previous is None:
                self.metrics.time_to_first_token.labels(self.model).observe(now - self.start)
            else:
                # A step may bring several tokens; each gets an equal share of the gap.
                for _ in range(count):
                    self.metrics.inter_token_latency.labels(self.model).observe(
                        (now - previous) / count
                    )
            self.last_token_at[choice] = now

    def finish(self) -> None:
        self.metrics.request_latency.labels(self.model).observe(time.perf_counter() - self.start)


class ScoringMetrics(ServerMetrics):
    def __init__(self):
        super().__init__()
        r = self.registry
        self.scored = Counter("swiftlm_scored_conversations", "Conversations scored.", registry=r)
        self.prompt_tokens = Counter(
            "swiftlm_prompt_tokens", "Tokens scored.", ["model"], registry=r
        )

    def count_scored(self, model: str, conversations: int, tokens: int) -> None:
        self.scored.inc(conversations)
        self.prompt_tokens.labels(model).inc(tokens)


# name (Prometheus adds `_total`), help text, the `EngineStats` field it counts
ENGINE_COUNTERS = (
    ("swiftlm_prefill_tokens", "Prompt tokens prefilled by the model.", "prefill_tokens"),
    (
        "swiftlm_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache (prefill saved).",
        "prefix_hit_tokens",
    ),
    (
        "swiftlm_spec_draft_tokens",
        "Speculative draft tokens checked by the model.",
        "draft_tokens",
    ),
    (
        "swiftlm_spec_accepted_tokens",
        "Speculative draft tokens accepted (generated without a forward of their own).",
        "accepted_draft_tokens",
    ),
)


class EngineCounters:
    """The engine's own token counts, read when /metrics is scraped: prompt tokens run
    through the model (`swiftlm_prefill_tokens_total`), prompt tokens whose keys and values
    came from the prefix cache instead (`swiftlm_prefix_cache_hit_tokens_total`), and
    speculative draft tokens checked and accepted (`swiftlm_spec_draft_tokens_total`,
    `swiftlm_spec_accepted_tokens_total`: their ratio is the acceptance rate)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, text, field in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, text, value=getattr(stats, field))
