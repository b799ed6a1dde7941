"""`swiftlm infer` end to end on the tiny Llama: resolving runs, batching, chat, adapters."""

import io
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from swiftlm.checkpoint.resolve import resolve_inference_model
from swiftlm.config import InferConfig, TrainConfig, save_config
from swiftlm.data.config import DataArguments
from swiftlm.engine.config import GenerationArguments
from swiftlm.errors import CheckpointError, ConfigError, DataError
from swiftlm.infer import run as run_module
from swiftlm.infer.frontend import ChatEngine, build_chat_engine
from swiftlm.infer.run import run
from swiftlm.models.config import ModelArguments
from tolerance import assert_close, forward_terms

SYSTEM = "You are Swifty."
GREEDY = GenerationArguments(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The tiny model is far faster on one thread; several threads spin against each other
    # when other test processes share the CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def save_lora_adapter(base_dir: Path, folders: list[Path]) -> None:
    """A LoRA on the tiny model with random lora_B, so it really changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    for folder in folders:
        model.save_pretrained(folder)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished LoRA run: config.yaml, final/ (+ tokenizer), one complete and one
    interrupted checkpoint."""
    from transformers import AutoTokenizer

    run = tmp_path_factory.mktemp("run")
    final, step2, step3 = (
        run / "final",
        run / "checkpoints" / "step-2",
        run / "checkpoints" / "step-3",
    )
    save_lora_adapter(tiny_model_dir, [final, step2, step3])
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(final)
    (step2 / "COMPLETE").write_text("step 2\n")
    config = TrainConfig(
        model=ModelArguments(model=str(tiny_model_dir), torch_dtype="float32"),
        data=DataArguments(system=SYSTEM),
    )
    save_config(config, run / "config.yaml")
    return run


def infer_config(**infer) -> InferConfig:
    cfg = InferConfig(generation=GREEDY)
    cfg.infer = replace(cfg.infer, **infer)
    return cfg


def base_config(tiny_model_dir) -> InferConfig:
    cfg = InferConfig(generation=GREEDY)
    cfg.model = ModelArguments(model=str(tiny_model_dir), torch_dtype="float32")
    return cfg


@pytest.fixture(scope="module")
def run_engine(run_dir) -> ChatEngine:
    cfg = infer_config(ckpt_dir=str(run_dir))
    return build_chat_engine(resolve_inference_model(cfg), cfg.model, seed=42)


# ---- resolving what to load ------------------------------------------------------------------


def test_run_dir_final_and_checkpoint_resolve_to_the_same_model(run_dir, tiny_model_dir):
    from_run = resolve_inference_model(infer_config(ckpt_dir=str(run_dir)))
    from_final = resolve_inference_model(infer_config(ckpt_dir=str(run_dir / "final")))
    step2 = run_dir / "checkpoints" / "step-2"
    from_step = resolve_inference_model(infer_config(ckpt_dir=str(step2)))
    from_adapters_flag = resolve_inference_model(infer_config(adapters=[str(run_dir)]))

    assert from_run == from_final == from_adapters_flag
    assert from_run.base_path == str(tiny_model_dir.resolve())
    assert from_run.adapters == (str((run_dir / "final").resolve()),)
    assert from_run.tokenizer_path == str(run_dir / "final")  # keeps the trained template
    assert (from_run.system, from_run.torch_dtype) == (SYSTEM, "float32")  # from config.yaml
    assert from_run.ckpt_dir == str(run_dir)
    # The checkpoint has no tokenizer files, so its tokenizer comes from the base model.
    assert from_step.adapters == (str(step2.resolve()),)
    assert from_step.tokenizer_path == from_step.base_path == from_run.base_path
    assert (from_step.system, from_step.torch_dtype, from_step.ckpt_dir) == (
        SYSTEM,
        "float32",
        str(run_dir),
    )


def test_user_flags_beat_the_run_config(run_dir):
    cfg = infer_config(ckpt_dir=str(run_dir))
    cfg.data = DataArguments(system="Be brief.")
    cfg.model = ModelArguments(torch_dtype="bfloat16")
    spec = resolve_inference_model(cfg)
    assert (spec.system, spec.torch_dtype) == ("Be brief.", "bfloat16")


def test_adapter_outside_a_run_takes_its_base_from_adapter_config(tmp_path, tiny_model_dir):
    save_lora_adapter(tiny_model_dir, [tmp_path / "adapter"])
    spec = resolve_inference_model(infer_config(adapters=[str(tmp_path / "adapter")]))
    assert spec.base_path == str(tiny_model_dir.resolve())
    assert spec.adapters == (str((tmp_path / "adapter").resolve()),)
    assert (spec.tokenizer_path, spec.system, spec.torch_dtype) == (spec.base_path, None, "auto")
    assert spec.ckpt_dir == str(tmp_path / "adapter")


def test_full_model_folder_loads_directly(tiny_model_dir):
    spec = resolve_inference_model(infer_config(ckpt_dir=str(tiny_model_dir)))
    assert (spec.base_path, spec.adapters) == (str(tiny_model_dir.resolve()), ())
    assert spec.tokenizer_path == spec.base_path


def test_run_without_final_lists_complete_checkpoints(run_dir, tmp_path):
    broken = tmp_path / "broken-run"
    (broken / "checkpoints" / "step-1").mkdir(parents=True)
    (broken / "checkpoints" / "step-1" / "COMPLETE").write_text("step 1\n")
    (broken / "checkpoints" / "step-2").mkdir()  # interrupted: not offered
    (broken / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    with pytest.raises(CheckpointError) as info:
        resolve_inference_model(infer_config(ckpt_dir=str(broken)))
    step1 = broken / "checkpoints" / "step-1"
    assert str(info.value) == (
        f"--ckpt_dir {broken}: the run has no final/ model (training did not finish?). "
        f"Complete checkpoints: {step1}; pass one as --ckpt_dir, e.g. --ckpt_dir {step1}"
    )


def test_incomplete_checkpoint_is_refused(run_dir):
    step3 = run_dir / "checkpoints" / "step-3"
    step2 = run_dir / "checkpoints" / "step-2"
    with pytest.raises(CheckpointError) as info:
        resolve_inference_model(infer_config(ckpt_dir=str(step3)))
    assert str(info.value) == (
        f"--ckpt_dir {step3}: this checkpoint is incomplete (no COMPLETE marker: the run "
        f"stopped while saving it). Complete checkpoints: {step2}; pass one as --ckpt_dir, "
        f"e.g. --ckpt_dir {step2}"
    )


def test_conflicting_model_flags_are_config_errors(run_dir, monkeypatch):
    both = infer_config(ckpt_dir=str(run_dir), adapters=[str(run_dir)])
    with monkeypatch.context() as patch:
        patch.setattr(run_module, "resolve_inference_model", None)  # fails if reached
        with pytest.raises(ConfigError) as info:
            run(both)  # the rule `ckpt_dir_or_adapters`, checked before anything loads
    assert str(info.value) == (
        "--ckpt_dir and --adapters both given: pass the checkpoint as --ckpt_dir, or the "
        "adapter folders as --adapters (with --model for their base model), not both"
    )
    cfg = InferConfig(model=ModelArguments(model=str(run_dir)))
    with pytest.raises(ConfigError, match=f"load it with --ckpt_dir {run_dir}"):
        resolve_inference_model(cfg)


# ---- generation -------------------------------------------------------------------------------


PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are a helpful assistant made by the swiftlm team."},
        {"role": "user", "content": "What is the capital of France? Tell me a story about a cat."},
    ],
    [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am a helpful assistant."},
        {"role": "user", "content": "The quick brown fox?"},
    ],
]


def test_batched_greedy_equals_one_by_one(run_engine):
    batched = run_engine.generate(PROMPTS, GREEDY)
    single = [run_engine.generate([p], GREEDY)[0] for p in PROMPTS]
    assert batched == single
    assert len(set(single)) == 3  # distinct answers: a mix-up between rows would show
    # The prompts differ in length, so the batch really was padded.
    lengths = {len(run_engine.encode(p)) for p in PROMPTS}
    assert len(lengths) == 3


def test_stream_yields_the_greedy_answer(run_engine):
    pieces = list(run_engine.stream(PROMPTS[1], GREEDY))
    assert len(pieces) > 1
    assert "".join(pieces) == run_engine.generate([PROMPTS[1]], GREEDY)[0]


def test_sampling_is_seeded_and_top_k_1_is_greedy(run_engine, run_dir):
    sampled = replace(GREEDY, temperature=1.5)
    cfg = infer_config(ckpt_dir=str(run_dir))
    spec = resolve_inference_model(cfg)
    first = build_chat_engine(spec, cfg.model, seed=7).generate(PROMPTS, sampled)
    assert build_chat_engine(spec, cfg.model, seed=7).generate(PROMPTS, sampled) == first
    assert first != run_engine.generate(PROMPTS, GREEDY)
    top1 = replace(sampled, top_k=1)
    assert run_engine.generate(PROMPTS, top1) == run_engine.generate(PROMPTS, GREEDY)


def test_stream_reraises_a_generation_error(run_engine, monkeypatch):
    def fail(**kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(run_engine.engine.scheduler, "model", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        list(run_engine.stream(PROMPTS[0], GREEDY))
    with pytest.raises(RuntimeError, match="out of memory"):
        run_engine.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert run_engine.generate(PROMPTS[:1], GREEDY)  # the engine keeps serving


def test_generation_stops_at_end_of_turn(run_engine):
    assert run_engine.stop_token_ids == [run_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.numerics
def test_adapter_is_applied(run_engine, run_dir, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_cfg = base_config(tiny_model_dir)
    base_engine = build_chat_engine(resolve_inference_model(base_cfg), base_cfg.model, seed=42)
    assert base_engine.generate(PROMPTS, GREEDY) != run_engine.generate(PROMPTS, GREEDY)
    # The merged weights compute what peft's unmerged adapter computes.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, run_dir / "final").eval()
    inputs = {"input_ids": torch.tensor([run_engine.encode(PROMPTS[0])])}
    with torch.inference_mode():
        expected = reference(**inputs).logits
        actual = run_engine.model(**inputs).logits
        plain = base_engine.model(**inputs).logits
    # merged weights (W + BA, rounded once) against peft's separate adapter matmuls: the same
    # sums in another order, through the forward's chain
    size = expected.abs().max().item()
    assert_close(actual, expected, terms=forward_terms(tokens=64), magnitude=size, what="logits")
    assert (actual - plain).abs().max() > 0.1


# ---- batch mode -------------------------------------------------------------------------------


def test_batch_mode_writes_one_line_per_sample_in_order(run_dir, run_engine, tmp_path, capsys):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
            ]
        },
        {"messages": PROMPTS[1][1:]},
        {"messages": PROMPTS[2]},
        {"instruction": "Who are you?", "output": "I am {{NAME}}."},
    ]
    data = write_jsonl(tmp_path / "val.jsonl", rows)
    result = tmp_path / "out" / "result.jsonl"
    cfg = infer_config(ckpt_dir=str(run_dir), result_path=str(result), max_batch_size=3)
    cfg.data = DataArguments(val_dataset=[str(data)])

    records = run(cfg)

    lines = [json.loads(line) for line in result.read_text(encoding="utf-8").splitlines()]
    assert lines == records
    assert [r["source"] for r in lines] == [f"{data}:{i}" for i in range(1, 5)]
    assert [r["labels"] for r in lines] == ["Hello!", None, None, "I am Swifty."]
    system = {"role": "system", "content": SYSTEM}  # inherited from the run's config.yaml
    prompts = [
        [system, {"role": "user", "content": "Hi"}],
        [system, *PROMPTS[1][1:]],
        [system, *PROMPTS[2]],
        [system, {"role": "user", "content": "Who are you?"}],
    ]
    assert [r["messages"] for r in lines] == prompts
    assert [r["response"] for r in lines] == [run_engine.generate([p], GREEDY)[0] for p in prompts]
    assert set(lines[0]) == {"messages", "response", "labels", "source"}
    out = capsys.readouterr().out
    assert "Answered 4 samples in " in out and f"results: {result}" in out


def test_batch_mode_with_speculative_decoding_writes_the_same_answers(
    run_dir, run_engine, tmp_path, monkeypatch
):
    """`--speculative_tokens` reaches the engine, which drafts, and the answers are the
    plain engine's (float32: token for token)."""
    prompts = [PROMPTS[1][1:], PROMPTS[2]]
    data = write_jsonl(tmp_path / "val.jsonl", [{"messages": p} for p in prompts])
    built = []

    def recording(*args, **kwargs):
        built.append(build_chat_engine(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(run_module, "build_chat_engine", recording)
    cfg = infer_config(
        ckpt_dir=str(run_dir), result_path=str(tmp_path / "out.jsonl"), speculative_tokens=4
    )
    cfg.data = DataArguments(val_dataset=[str(data)])
    records = run(cfg)
    system = {"role": "system", "content": SYSTEM}
    expected = [run_engine.generate([[system, *p]], GREEDY)[0] for p in prompts]
    assert [r["response"] for r in records] == expected
    assert built[0].engine.stats().draft_tokens > 0


@pytest.mark.bad_input(
    input="`swiftlm infer --val_dataset` with rows that cannot be answered: a prompt longer "
    "than the context, or a row whose generation fails inside the engine",
    outcome="The other rows' answers are all written (the failed rows' lines have "
    '"response": null and an "error"); then exit 1 naming each failed row by file:line',
)
def test_batch_rows_that_fail_lose_no_other_answers(run_dir, run_engine, tmp_path, monkeypatch):
    from swiftlm.engine import scheduler

    accept = scheduler.Sequence.accept

    def failing_accept(seq, token, logprob):
        # A failure inside the engine, in the middle of one row's answer only.
        prompt = seq.detokenizer.tokenizer.decode(seq.row.prompt_ids)
        if "POISON" in prompt and len(seq.row.output_ids) == 2:
            raise RuntimeError("detokenizing broke")
        return accept(seq, token, logprob)

    monkeypatch.setattr(scheduler.Sequence, "accept", failing_accept)
    rows = [
        {"messages": PROMPTS[0]},
        {"messages": [{"role": "user", "content": "POISON " * 3}]},
        {"messages": PROMPTS[2]},
        {"messages": [{"role": "user", "content": "word " * 700}]},  # past the 512 context
    ]
    data = write_jsonl(tmp_path / "val.jsonl", rows)
    result = tmp_path / "result.jsonl"
    cfg = infer_config(ckpt_dir=str(run_dir), result_path=str(result))
    cfg.data = DataArguments(val_dataset=[str(data)])

    with pytest.raises(DataError) as info:
        run(cfg)

    lines = [json.loads(line) for line in result.read_text(encoding="utf-8").splitlines()]
    assert [r["source"] for r in lines] == [f"{data}:{i}" for i in range(1, 5)]
    system = {"role": "system", "content": SYSTEM}
    for i in (0, 2):
        expected = run_engine.generate([[system, *rows[i]["messages"]]], GREEDY)[0]
        assert lines[i]["response"] == expected and "error" not in lines[i]
    assert lines[1]["response"] is None and lines[1]["error"] == "RuntimeError: detokenizing broke"
    assert lines[3]["response"] is None and "leaves no room" in lines[3]["error"]
    message = str(info.value)
    assert message.startswith(
        f"2 of 4 rows could not be answered; the other answers are written to {result}"
    )
    assert f"{data}:2: RuntimeError: detokenizing broke" in message
    assert f"{data}:4: a prompt of " in message


def test_batch_mode_default_result_path_is_in_the_run(run_dir, tmp_path):
    data = write_jsonl(tmp_path / "val.jsonl", [{"messages": PROMPTS[0]}])
    cfg = infer_config(ckpt_dir=str(run_dir / "final"))
    cfg.data = DataArguments(val_dataset=[str(data)])
    run(cfg)
    written = list((run_dir / "infer_result").glob("*.jsonl"))
    assert len(written) == 1
    assert json.loads(written[0].read_text())["source"] == f"{data}:1"


# ---- interactive chat -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_keeps_history_and_prints_answers(run_dir, monkeypatch, capsys, stream):
    calls = []
    method = "stream" if stream else "generate"
    original = getattr(ChatEngine, method)

    def spy(self, conversations, gen):
        conversation = conversations if stream else conversations[0]
        calls.append([dict(m) for m in conversation])
        result = original(self, conversations, gen)
        return list(result) if stream else result

    monkeypatch.setattr(ChatEngine, method, spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Who are you?\nWhat is the capital of France?\n"))
    cfg = infer_config(ckpt_dir=str(run_dir), stream=stream)

    assert run(cfg) is None

    system = {"role": "system", "content": SYSTEM}
    first = {"role": "user", "content": "Who are you?"}
    second = {"role": "user", "content": "What is the capital of France?"}
    assert len(calls) == 2
    assert calls[0] == [system, first]
    engine = build_chat_engine(resolve_inference_model(cfg), cfg.model, seed=42)
    answer1 = engine.generate([[system, first]], GREEDY)[0]
    assert calls[1] == [system, first, {"role": "assistant", "content": answer1}, second]
    answer2 = engine.generate([calls[1]], GREEDY)[0]
    transcript = capsys.readouterr().out.split("\n", 1)[1]  # after the "Loading ..." line
    assert (
        transcript
        == f"<<< {first['content']}\n>>> {answer1}\n<<< {second['content']}\n>>> {answer2}\n"
    )


def test_chat_commands_clear_and_exit(run_dir, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(
        ChatEngine, "generate", lambda self, convs, gen: calls.append(convs[0]) or ["ok"]
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("one\nclear\n\ntwo\nexit\nthree\n"))
    run(infer_config(ckpt_dir=str(run_dir), stream=False))
    system = {"role": "system", "content": SYSTEM}
    assert calls == [
        [system, {"role": "user", "content": "one"}],
        [system, {"role": "user", "content": "two"}],  # history was cleared; "three" never asked
    ]
    assert capsys.readouterr().out.split("\n", 1)[1] == (
        "<<< one\n>>> ok\n<<< clear\nHistory cleared.\n<<< \n<<< two\n>>> ok\n<<< exit\n"
    )


def test_bad_generation_flags_fail_before_loading():
    # GenerationArguments checks its fields when it is built: before any model can load.
    with pytest.raises(ConfigError) as info:
        GenerationArguments(temperature=-1, top_p=0)
    assert str(info.value) == (
        "--temperature -1 must be 0 (greedy) or more; --top_p 0 must be in (0, 1]"
    )


@pytest.mark.bad_input(
    input="`--infer_backend vllm` where vLLM is not installed, or `--infer_backend sglang`",
    outcome="Exit 2 before the model loads: vllm names its install command "
    "(`scripts/setup_vllm.sh` on a CPU), sglang says it is not built and to use vllm or pt",
)
def test_a_backend_that_cannot_run_is_refused_by_name(tiny_model_dir, capsys):
    import importlib.util

    from swiftlm.cli.main import main

    argv = ["infer", "--model", str(tiny_model_dir), "--infer_backend"]
    assert main([*argv, "sglang"]) == 2
    assert "--infer_backend sglang: not built yet" in capsys.readouterr().err
    from swiftlm.engine.build import EngineOptions, check_backend

    with pytest.raises(ConfigError, match="vlm is a vision-language model.*--infer_backend pt"):
        check_backend(EngineOptions(infer_backend="vllm"), "vlm", vision=True)
    check_backend(EngineOptions(infer_backend="vllm"), "llm", vision=False)
    if importlib.util.find_spec("vllm") is None:  # .venv-vllm runs the vLLM tests instead
        assert main([*argv, "vllm"]) == 2
        err = capsys.readouterr().err
        assert "--infer_backend vllm: vLLM cannot be imported here" in err
        assert "bash scripts/setup_vllm.sh" in err
