"""Two claims of the served engine, over the real server and a tiny model: a short request's
first token does not wait for a long generation to end (continuous batching), and base + 3
adapters hold one copy of the base weights while each adapter answers differently."""

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import ServerThread  # noqa: E402

from swiftlm.engine.packed_weights import PackedLinear  # noqa: E402

ADAPTERS = ("alpha", "beta", "gamma")
MESSAGES = [{"role": "user", "content": "Who are you?"}]


def make_adapter(model_dir, out, seed: int):
    """A LoRA adapter with random A and B (init_lora_weights=False), so it changes the answers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(
        r=8,
        lora_alpha=64,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    )
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from swiftlm.engine.build import build_engine

    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: str(make_adapter(tiny_model_dir, root / name, seed))
        for seed, name in enumerate(ADAPTERS)
    }
    engine = build_engine(
        str(tiny_model_dir), adapters=adapters, max_num_seqs=4, max_model_len=640, seed=0
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    app = generation_app(engine, engine.tokenizer, ServedModels("tiny", ADAPTERS), ServerSettings())
    with ServerThread(app) as url:
        yield url


def stream_times(url: str, body: dict, out: dict) -> dict:
    """Stream a chat completion, filling `out` as it goes: when its first content arrived
    (`first`), when it ended (`end`), and its `usage`."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            if "first" not in out and any(c["delta"].get("content") for c in chunk["choices"]):
                out["first"] = time.monotonic()
    out["end"] = time.monotonic()
    return out


def test_a_short_request_gets_its_first_token_while_a_long_generation_runs(server):
    long_body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 512, "ignore_eos": True}
    long = {}
    thread = threading.Thread(target=stream_times, args=(server, long_body, long))
    thread.start()
    deadline = time.monotonic() + 60
    while "first" not in long and thread.is_alive():  # the long one is generating
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "end" not in long
    short = stream_times(server, {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}, {})
    thread.join(timeout=120)
    assert long["usage"]["completion_tokens"] == 512
    assert short["usage"]["completion_tokens"] >= 1
    # The short answer started, and even ended, before the long generation finished.
    assert short["first"] < short["end"] < long["end"], (short, long)


def test_base_weights_are_held_once_with_three_adapters(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain_numel = sum(p.numel() for p in plain.parameters())

    served = dict(engine.model.named_parameters(remove_duplicate=False))
    lora = {n: p for n, p in served.items() if "lora_" in n}
    base = {n: p for n, p in served.items() if "lora_" not in n}
    per_adapter = {a: sum(p.numel() for n, p in lora.items() if f".{a}." in n) for a in ADAPTERS}
    assert sum(per_adapter.values()) == sum(p.numel() for p in lora.values())
    assert len(set(per_adapter.values())) == 1 and per_adapter["alpha"] > 0
    # Linear layers packed for oneDNN (--packed_weights, on by default for a bf16 CPU engine)
    # hold their weight as one opaque tensor each instead of a parameter.
    packed = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    # Every base tensor once: as many distinct storages as the plain model has parameters...
    distinct = len({p.data_ptr() for p in base.values()}) + len(packed)
    assert distinct == len(list(plain.parameters()))
    # ...and all the served weights (counted once per storage) are the base's plus the three
    # adapters' LoRA matrices: no per-adapter copy of the base (the engine may cast its dtype).
    storages = {p.data_ptr(): p.numel() for p in served.values()}
    held = sum(storages.values()) + sum(m.weight_numel for m in packed)
    assert held == plain_numel + 3 * per_adapter["alpha"]


def test_each_adapter_answers_differently_from_the_base(server):
    def answer(model: str) -> str:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
        reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    answers = {model: answer(model) for model in ("tiny", *ADAPTERS)}
    assert len(set(answers.values())) == 4, answers
    assert answer("tiny") == answers["tiny"]  # the base is back after the adapters ran
