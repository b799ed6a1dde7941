"""The routes of `swiftlm rollout` (serve/rollout.py): `GET /info/`, `POST /weights/init/`,
`/weights/update/`, `/weights/wait/`, `/weights/close/` and `/generate/`, over a `RolloutService` (the vLLM
engine, and the one weight-sync call that may be pending at a time)."""

import dataclasses
import threading
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from swiftlm.engine.protocol import GenerationFailed, GenerationRequest, SamplingParams
from swiftlm.serve.errors import APIError

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)

    @model_validator(mode="before")
    @classmethod
    def _known_params(cls, data: Any) -> Any:
        params = data.get("params") if isinstance(data, dict) else None
        if isinstance(params, dict) and set(params) - SAMPLING_FIELDS:
            unknown = sorted(set(params) - SAMPLING_FIELDS)[0]
            raise ValueError(
                f"params.{unknown} is not a sampling field; known: {sorted(SAMPLING_FIELDS)}"
            )
        return data


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[RolloutRequest] = Field(min_length=1)


class InitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_port: int = Field(ge=1, le=65535)
    trainer_device: str = Field(pattern="^(cpu|cuda)$")
    timeout_s: float = Field(gt=0, default=240.0)


class TensorSpecBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    shape: list[int]
    dtype: str = Field(pattern="^(float32|float16|bfloat16)$")


class UpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    buckets: list[list[TensorSpecBody]] = Field(min_length=1)


class RolloutService:
    """The engine, and the one worker call (weight sync) that may be pending at a time."""

    def __init__(self, engine, host: str, metrics, model_name: str):
        self.engine = engine
        self.host = host
        self.metrics = metrics
        self.model_name = model_name
        self.workers = engine.workers
        self.synced = False  # a weight-sync group is formed
        self._pending: threading.Thread | None = None
        self._outcome: dict = {}
        self._lock = threading.Lock()

    def info(self) -> dict:
        return {
            "model": self.model_name,
            "dtype": self.engine.dtype,
            "device": self.engine.device_type,
            "workers": self.workers,
            "vocab_size": self.engine.vocab_size,
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": self.engine.max_num_seqs,
        }

    def init_sync(self, body: InitBody) -> dict:
        from swiftlm.engine.vllm_weight_sync import sync_backend

        backend = sync_backend(body.trainer_device, self.engine.device_type)
        args = (self.host, body.group_port, self.workers, backend, body.timeout_s)
        self._start("init_weight_sync", args, then=lambda: setattr(self, "synced", True))
        return {"backend": backend, "workers": self.workers}

    def update(self, body: UpdateBody) -> dict:
        if not self.synced:
            raise APIError(409, "no weight-sync group yet: POST /weights/init/ first")
        buckets = [[spec.model_dump() for spec in bucket] for bucket in body.buckets]
        self._start("receive_weights", (buckets,), then=self.engine.reset_prefix_cache)
        return {"tensors": sum(len(bucket) for bucket in buckets)}

    def wait(self) -> dict:
        """Until the pending worker call ends: its result, or its error (a 500: the
        workers failed, or the trainer sent weights this model does not have)."""
        with self._lock:
            pending = self._pending
        if pending is None:
            raise APIError(
                409, "no weight-sync call is pending: POST /weights/init/ or /weights/update/ first"
            )
        pending.join()
        with self._lock:
            self._pending, outcome = None, self._outcome
        if "error" in outcome:
            raise APIError(
                500, f"{outcome['method']} failed on the vLLM workers: {outcome['error']}"
            )
        return outcome

    def close_sync(self) -> dict:
        """Drop the weight-sync group (a trainer that is done): its port is free again."""
        with self._lock:
            if self._pending is not None:
                raise APIError(409, "a weight-sync call is pending: POST /weights/wait/ first")
            if self.synced:
                self.engine.call_workers("close_weight_sync")
                self.synced = False
        return {"closed": True}

    def generate(self, body: GenerateBody) -> dict:
        with self._lock:
            if self._pending is not None:
                raise APIError(
                    409, "a weight push is pending: POST /weights/wait/ before generating"
                )
        requests = [GenerationRequest(r.prompt_ids, _tupled(r.params)) for r in body.requests]
        for index, request in enumerate(requests):
            try:
                self.engine.validate(request)
            except ValueError as exc:
                raise APIError(
                    400, f"requests[{index}]: {exc}", param=f"requests.{index}"
                ) from None
        try:
            results = self.engine.generate(requests)
        except GenerationFailed as exc:
            results = exc.results  # each failed sample carries its error
        self.metrics.requests.labels(self.model_name, "generate").inc(len(requests))
        return {"results": [[_sample_json(s) for s in samples] for samples in results]}

    def _start(self, method: str, args: tuple, then) -> None:
        with self._lock:
            if self._pending is not None:
                raise APIError(409, "a weight-sync call is pending: POST /weights/wait/ first")
            self._outcome = {}

            def call():
                try:
                    result = self.engine.call_workers(method, *args)
                    then()
                    self._outcome = {"method": method, "result": result}
                except Exception as exc:  # reported by /weights/wait/
                    self._outcome = {"method": method, "error": f"{type(exc).__name__}: {exc}"}

            self._pending = threading.Thread(target=call, name=f"swiftlm-{method}", daemon=True)
            self._pending.start()


def _tupled(params: SamplingParams) -> SamplingParams:
    """pydantic fills the tuple fields with lists when given JSON."""
    return dataclasses.replace(
        params, stop=tuple(params.stop), stop_token_ids=tuple(params.stop_token_ids)
    )


def _sample_json(sample) -> dict:
    return {
        "index": sample.index,
        "token_ids": list(sample.token_ids),
        "text": sample.text,
        "logprobs": [lp.logprob for lp in sample.logprobs],
        "finish_reason": sample.finish_reason,
        "error": sample.error,
    }


def rollout_router(service: RolloutService) -> APIRouter:
    router = APIRouter()
    # Plain `def` routes: FastAPI runs them in its thread pool, where they may block.
    router.get("/info/")(service.info)
    router.post("/weights/init/")(service.init_sync)
    router.post("/weights/update/")(service.update)
    router.post("/weights/wait/")(service.wait)
    router.post("/weights/close/")(service.close_sync)
    router.post("/generate/")(service.generate)
    return router
