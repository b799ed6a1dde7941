"""`swiftlm infer` with a vision-language model (the tiny random LLaVA of vlm_helpers): a chat
question with `--images` or `/image`, batch inference over rows with images, and the errors
(a bad image names its row, images for a text model, --images in batch mode).

Generation runs through engine.vision.VisionEngine (transformers' generate with the model's
processor), so its greedy answer must be transformers' own on the same processed inputs."""

import io
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from swiftlm.checkpoint.resolve import resolve_inference_model
from swiftlm.cli.main import main
from swiftlm.config import InferConfig
from swiftlm.data.rows import RowError
from swiftlm.engine.config import GenerationArguments
from swiftlm.infer.chat_images import question_content
from swiftlm.infer.frontend import VisionChatEngine, build_chat_engine
from swiftlm.models.config import ModelArguments
from vlm_helpers import build_llava, colour_rows, write_picture

NEW_TOKENS = 8
GREEDY = GenerationArguments(max_new_tokens=NEW_TOKENS, temperature=0.0)
CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pictures")
    return {
        "red": write_picture(folder / "red.png", (220, 20, 20)),
        "blue": write_picture(folder / "blue.png", (20, 20, 220), size=(30, 44), seed=3),
    }


@pytest.fixture(scope="module")
def engine(llava):
    cfg = InferConfig(model=ModelArguments(model=str(llava)))
    chat = build_chat_engine(resolve_inference_model(cfg), cfg.model, seed=42)
    yield chat
    chat.shutdown()


def transformers_answer(llava: Path, text: str, images: list[Path]) -> tuple[list[int], str]:
    """Greedy new token ids and text of transformers' own generate on the processor's inputs."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(llava)
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    pixels = [Image.open(p).convert("RGB") for p in images] or None
    inputs = processor(text=[CHATML.format(text)], images=pixels, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return ids, processor.tokenizer.decode(ids, skip_special_tokens=True)


def chat(monkeypatch, capsys, argv: list[str], stdin: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["infer", *argv, "--max_new_tokens", str(NEW_TOKENS), "--stream", "false"])
    out = capsys.readouterr()
    return code, out.out, out.err


def answers(stdout: str) -> list[str]:
    return [line[len(">>> ") :] for line in stdout.splitlines() if line.startswith(">>> ")]


def test_a_question_with_images_answers_as_transformers_generate(
    llava, pictures, engine, monkeypatch, capsys
):
    question = "What colour is this?"
    argv = ["--model", str(llava), "--images", str(pictures["red"])]
    code, out, err = chat(monkeypatch, capsys, argv, question + "\n")
    assert code == 0, err
    assert "continuous batching is text-only" in out  # the startup line names the backend
    # No <image> tag in the question: the image goes in front of the text.
    ids, text = transformers_answer(llava, "<image>" + question, [pictures["red"]])
    (answer,) = answers(out)
    # The streamed text holds back a trailing incomplete character, as the text engine does.
    assert answer == text.rstrip("\ufffd")

    # Token for token: the vision engine's ids are transformers' (the end-of-turn included).
    conversation = [{"role": "user", "content": question_content(question, [str(pictures["red"])])}]
    request = engine.request(conversation, GREEDY)
    assert request.features["pixel_values"].shape[0] == 1
    (sample,) = engine.engine.generate([request])[0]
    assert sample.token_ids == ids


def test_images_fill_the_tags_in_order_and_a_text_question_needs_none(
    llava, pictures, engine, monkeypatch, capsys
):
    red, blue = str(pictures["red"]), str(pictures["blue"])
    content = question_content("Compare <image> with <image>.", [red, blue])
    assert content == [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": red},
        {"type": "text", "text": " with "},
        {"type": "image", "image": blue},
        {"type": "text", "text": "."},
    ]
    with pytest.raises(RowError, match="2 <image> tag\\(s\\) but 1 image"):
        question_content("<image> and <image>", [red])

    # /image attaches to the next question only; then a text question to the same model.
    stdin = f"/image {blue}\nWhich one?\nSay hello.\n"
    code, out, err = chat(monkeypatch, capsys, ["--model", str(llava)], stdin)
    assert code == 0, err
    assert "Attached 1 image(s) to the next question." in out
    first, second = answers(out)
    assert first == transformers_answer(llava, "<image>Which one?", [pictures["blue"]])[1].rstrip(
        "\ufffd"
    )
    # The second question sees the first turn (with its image) as history.
    history = [
        {"role": "user", "content": question_content("Which one?", [blue])},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Say hello."},
    ]
    assert second == engine.generate([history], GREEDY)[0]
    # A text-only question with no history: transformers' answer without pixel values.
    alone = engine.generate([[{"role": "user", "content": "Say hello."}]], GREEDY)[0]
    assert alone == transformers_answer(llava, "Say hello.", [])[1].rstrip("\ufffd")


def test_a_tag_without_an_image_is_not_asked(llava, monkeypatch, capsys):
    code, out, err = chat(monkeypatch, capsys, ["--model", str(llava)], "<image> what?\n")
    assert code == 0, err
    assert "Not asked: the question has 1 <image> tag(s) but no image is attached" in out
    assert answers(out) == []


def test_batch_rows_with_images_are_answered_in_order(llava, engine, tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    rows = colour_rows(data_dir, count=3)  # <image> + relative images, an image_url, text only
    data = data_dir / "val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    result = tmp_path / "result.jsonl"
    monkeypatch.chdir(tmp_path)  # image paths are relative to the data file, not the cwd

    argv = ["--model", str(llava), "--val_dataset", str(data), "--result_path", str(result)]
    assert main(["infer", *argv, "--max_new_tokens", str(NEW_TOKENS)]) == 0

    records = [json.loads(line) for line in result.read_text(encoding="utf-8").splitlines()]
    assert [r["source"] for r in records] == [f"{data}:{i}" for i in range(1, 6)]
    assert [r["labels"] for r in records] == [
        "It is red.",
        "It is green.",
        "It is blue.",
        "Green.",
        "Hello.",
    ]
    first = records[0]["messages"][0]["content"]
    assert first == [
        {"type": "image", "image": str((data_dir / "picture0.png").resolve())},
        {"type": "text", "text": "What colour is this?"},
    ]
    assert records[3]["messages"][0]["content"][0] == {
        "type": "image",
        "image": str((data_dir / "picture1.png").resolve()),
    }
    assert records[4]["messages"] == [{"role": "user", "content": "Say hello."}]
    # Each answer is the one a single question gets.
    assert [r["response"] for r in records] == [
        engine.generate([r["messages"]], GREEDY)[0] for r in records
    ]
    ids, text = transformers_answer(
        llava, "<image>What colour is this?", [data_dir / "picture0.png"]
    )
    assert records[0]["response"] == text.rstrip("\ufffd")


def test_a_bad_image_in_the_batch_file_names_its_line_before_loading(
    llava, pictures, tmp_path, capsys
):
    (tmp_path / "broken.png").write_bytes(b"this is not a png")
    rows = [
        {
            "messages": [{"role": "user", "content": "<image>Fine?"}],
            "images": [str(pictures["red"])],
        },
        {"messages": [{"role": "user", "content": "<image>Where?"}], "images": ["missing.png"]},
        {"messages": [{"role": "user", "content": "<image>Broken?"}], "images": ["broken.png"]},
        {
            "messages": [{"role": "user", "content": "Two tags <image><image>"}],
            "images": ["broken.png"],
        },
    ]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    code = main(["infer", "--model", str(llava), "--val_dataset", str(data)])

    out = capsys.readouterr()
    assert code != 0
    assert "Loading" not in out.out  # checked before the model loads
    assert f"{data}:2" in out.err and "'missing.png' does not exist" in out.err
    assert f"{data}:3" in out.err and "not an image PIL can read" in out.err
    assert f"{data}:4" in out.err and "2 <image> tag(s) but 'images' lists 1 image(s)" in out.err
    assert f"{data}:1" not in out.err


@pytest.mark.bad_input(
    input="`swiftlm infer --images x.png` with a text-only model, a missing image, or with "
    "--val_dataset",
    outcome="Error before the model loads naming the flag and the fix",
)
def test_image_flag_errors(llava, tiny_model_dir, pictures, tmp_path, capsys):
    red = str(pictures["red"])
    assert main(["infer", "--model", str(tiny_model_dir), "--images", red]) == 2
    err = capsys.readouterr().err
    assert "--images" in err and "text-only model" in err and "drop --images" in err

    assert main(["infer", "--model", str(llava), "--images", str(tmp_path / "nope.png")]) == 2
    err = capsys.readouterr().err
    assert "--images image 1" in err and "does not exist" in err

    data = tmp_path / "val.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    argv = ["infer", "--model", str(llava), "--images", red, "--val_dataset", str(data)]
    assert main(argv) == 2
    assert "--val_dataset rows carry their own" in capsys.readouterr().err


def test_image_rows_for_a_text_model_are_refused(tiny_model_dir, pictures, tmp_path, capsys):
    rows = [
        {"messages": [{"role": "user", "content": "<image>hi"}], "images": [str(pictures["red"])]}
    ]
    data = tmp_path / "val.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    assert main(["infer", "--model", str(tiny_model_dir), "--val_dataset", str(data)]) != 0
    err = capsys.readouterr().err
    assert f"{data}:1" in err and "images" in err and "vision-language" in err


def test_the_vision_chat_engine_is_used_for_vision_models(engine):
    assert isinstance(engine, VisionChatEngine) and engine.takes_images


@pytest.mark.parametrize("architecture", ["idefics3", "qwen2_vl"])
def test_other_architectures_generate_as_transformers(architecture, pictures, tmp_path):
    """Their extra processor outputs (pixel_attention_mask, image_grid_thw ...) reach generate."""
    from swiftlm.models import vision
    from vlm_helpers import BUILDERS, patched_qwen2_vl_loading

    folder = BUILDERS[architecture](tmp_path / architecture)
    cfg = InferConfig(model=ModelArguments(model=str(folder)))
    with patched_qwen2_vl_loading():
        chat = build_chat_engine(resolve_inference_model(cfg), cfg.model, seed=42)
        processor = vision.load_processor(str(folder))
    try:
        content = question_content("Which colour? <image>", [str(pictures["blue"])])
        request = chat.request([{"role": "user", "content": content}], GREEDY)
        (sample,) = chat.engine.generate([request])[0]
    finally:
        chat.shutdown()
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    text = processor.tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Which colour? "}, {"type": "image"}],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    image = Image.open(pictures["blue"]).convert("RGB")
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    assert request.prompt_ids == inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert sample.token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_named_adapters_are_refused_for_a_vision_model(llava):
    from swiftlm.engine.vision import build_vision_engine
    from swiftlm.errors import ConfigError

    with pytest.raises(ConfigError, match="continuous-batching engine, which is text-only"):
        build_vision_engine(str(llava), adapters={"a": "/nowhere"})


def test_sampling_is_seeded_and_stop_strings_and_budgets_end_samples(engine, pictures):
    from dataclasses import replace

    from swiftlm.engine.protocol import SamplingParams

    content = question_content("Which?", [str(pictures["red"])])
    request = engine.request([{"role": "user", "content": content}], GREEDY)
    vision = engine.engine

    def run(**params) -> list:
        return vision.generate([replace(request, params=SamplingParams(**params))])[0]

    sampled = dict(max_tokens=6, temperature=1.5, ignore_eos=True, seed=7, n=2)
    first, again = run(**sampled), run(**sampled)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]  # seed + i per sample
    assert first[0].token_ids != first[1].token_ids
    assert all(len(s.token_ids) == 6 and s.finish_reason == "length" for s in first)

    text = run(max_tokens=6, temperature=0, ignore_eos=True)[0].text
    assert len(text) >= 2
    stop = text[1:3]
    (stopped,) = run(max_tokens=6, temperature=0, ignore_eos=True, stop=(stop,))
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]


def test_an_aborted_request_stops_at_the_next_token(engine, pictures):
    import queue
    from dataclasses import replace

    from swiftlm.engine.protocol import SamplingParams

    content = question_content("Which?", [str(pictures["red"])])
    request = engine.request([{"role": "user", "content": content}], GREEDY)
    request = replace(request, params=SamplingParams(max_tokens=200, ignore_eos=True))
    deltas: queue.Queue = queue.Queue()
    engine.engine.submit(request, deltas.put)
    assert deltas.get(timeout=60).finish_reason is None
    engine.engine.abort(request.request_id)
    received = [deltas.get(timeout=60)]
    while received[-1].finish_reason is None:
        received.append(deltas.get(timeout=60))
    assert received[-1].finish_reason == "abort" and len(received) < 20
    deadline = time.monotonic() + 10  # the worker leaves generate right after the last delta
    while engine.engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.engine.stats().running == 0


def test_a_runs_max_pixels_is_inherited_unless_set():
    from types import SimpleNamespace

    from swiftlm.checkpoint.resolve import _inherit_max_pixels
    from swiftlm.data.config import DataArguments

    run = SimpleNamespace(run_config=SimpleNamespace(data=DataArguments(max_pixels=4096)))
    assert _inherit_max_pixels(InferConfig(), run) == 4096
    assert _inherit_max_pixels(InferConfig(data=DataArguments(max_pixels=100)), run) == 100
    assert _inherit_max_pixels(InferConfig(), SimpleNamespace(run_config=None)) == 0
