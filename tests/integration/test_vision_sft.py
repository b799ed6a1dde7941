"""Vision-language SFT through `swiftlm sft` on tiny random Qwen2-VL, LLaVA and Idefics3
folders: the step-1 loss equals transformers' own loss on the same batch, bad image rows are
named before training, the tokenized-data cache skips image preprocessing and says so, and
truncation never cuts an image."""

import base64
import uuid
from unittest import mock

import pytest
import torch

import vlm_helpers as vh
from conftest import logged, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, forward_terms

QUESTION = "What colour is this?"


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    """The tiny folder of each architecture, built once per module when first asked for."""
    built = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = vh.BUILDERS[arch](tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


def run_sft(model_dir, data, out, **flags) -> int:
    """`swiftlm sft` in-process (Qwen2-VL's processor built without torchvision)."""
    with vh.patched_qwen2_vl_loading():
        return main(tiny_sft(model_dir, data, out, **flags))


def reference_processor(arch: str, folder):
    """The model's processor as transformers builds it (Qwen2-VL: without its video half)."""
    if arch == "qwen2_vl":
        return vh.qwen2_vl_processor(folder)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


# Four pictures of different sizes (different patch grids / crop counts per architecture),
# one given as an OpenAI image_url part, the others as <image> tags with relative paths.
PICTURES = [("red", (40, 32)), ("green", (24, 24)), ("blue", (96, 32)), ("red", (30, 70))]


def parity_rows(folder) -> tuple[list[dict], list[tuple]]:
    """(rows, [(image path, question, answer)]) of the parity batch."""
    rows, spec = [], []
    for index, (colour, size) in enumerate(PICTURES):
        path = vh.write_picture(folder / f"p{index}.png", vh.COLOURS[colour], size, seed=index)
        answer = f"It is {colour}, picture {index}."
        if index == 3:
            part = {"type": "image_url", "image_url": {"url": str(path)}}
            user = {"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}
            rows.append({"messages": [user, {"role": "assistant", "content": answer}]})
        else:
            messages = [
                {"role": "user", "content": f"<image>{QUESTION}"},
                {"role": "assistant", "content": answer},
            ]
            rows.append({"messages": messages, "images": [path.name]})
        spec.append((path, QUESTION, answer))
    return rows, spec


def transformers_loss(arch: str, folder, spec: list[tuple]) -> tuple[float, int, int]:
    """transformers' own loss of the batch: its processor builds the inputs, the labels are
    the assistant answer and its end-of-turn token (nothing else), the model averages. With
    the label count and the padded batch's width."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    processor = reference_processor(arch, folder)
    tokenizer = processor.tokenizer
    texts, images, answers = [], [], []
    for path, question, answer in spec:
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        texts.append(processor.apply_chat_template(messages, tokenize=False))
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
        answers.append(tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"])
    # Idefics3 takes a list of images per text; the others a flat list.
    nested = [[image] for image in images] if arch == "idefics3" else images
    inputs = processor(text=texts, images=nested, padding=True, return_tensors="pt")
    ids = inputs["input_ids"]
    labels = torch.full_like(ids, -100)
    for row, answer in enumerate(answers):
        tokens, n = ids[row].tolist(), len(answer)
        starts = [s for s in range(len(tokens) - n + 1) if tokens[s : s + n] == answer]
        assert len(starts) == 1, f"answer of row {row} not found once in {tokens}"
        labels[row, starts[0] : starts[0] + n] = ids[row, starts[0] : starts[0] + n]
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        loss = model(**inputs, labels=labels).loss.item()
    return loss, int((labels[:, 1:] != -100).sum()), ids.shape[1]


@pytest.mark.numerics
@pytest.mark.parametrize("layout", ["padded", "default"])
@pytest.mark.parametrize("arch", vh.ARCHITECTURES)
def test_step_one_loss_equals_transformers_loss(vlm_dirs, arch, layout, tmp_path, capsys):
    """`padded`: one padded row per sample; `default`: the layout swiftlm picks on its own
    (padding-free rows where it builds them)."""
    folder = vlm_dirs(arch)
    rows, spec = parity_rows(tmp_path)
    data = write_jsonl(tmp_path / "colours.jsonl", rows)
    out = tmp_path / "run"
    # One micro-batch of all 4 rows: the batch's order does not change its token mean.
    flags = dict(max_steps=1, per_device_train_batch_size=4, lora_dropout=0, seed=3, data_seed=3)
    if layout == "padded":
        flags["padding_free"] = "false"
    assert run_sft(folder, data, out, **flags) == 0
    printed = capsys.readouterr().out
    assert "batches: 1 micro-batches per epoch" in printed
    if layout == "padded":  # the pictures differ in size: so do the rows
        assert "padding 0.0% of computed tokens" not in printed
    [swiftlm_loss] = logged(out, "loss")
    [label_tokens] = logged(out, "label_tokens")
    reference, reference_labels, width = transformers_loss(arch, folder, spec)
    assert label_tokens == reference_labels
    # The initial weights (LoRA's B is zero), the same samples, other rows: a row holds at most
    # the 4 samples (padding-free), and the image tower before the text model (2 layers, at
    # most 64 wide) has the shorter chain, so twice the text model's covers both.
    terms = 2 * forward_terms(4 * width)
    assert_close(swiftlm_loss, reference, terms=terms, what=f"{arch} step-1 loss")
    assert reference > 1.0  # a random model: the comparison is not of two near-zero numbers


def _row(content: str, images: list[str], answer: str = "Red.") -> dict:
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "images": images}


@pytest.mark.bad_input(
    input="swiftlm sft on a vision-language model with rows whose <image> tags and images "
    "differ in number, or whose image is missing, not an image, or a truncated file",
    outcome="Stops before training listing each row (file:line: reason); base64 data URL "
    "images are read",
)
def test_bad_image_rows_are_named_before_training(vlm_dirs, tmp_path, capsys):
    good = vh.write_picture(tmp_path / "good.png", vh.COLOURS["red"])
    (tmp_path / "corrupt.png").write_bytes(bytes(range(256)) * 8)
    png = good.read_bytes()
    (tmp_path / "truncated.png").write_bytes(png[: len(png) // 2])
    jpeg = tmp_path / "truncated.jpg"
    _truncated_jpeg(jpeg)
    inline = "data:image/png;base64," + base64.b64encode(png).decode()
    rows = [
        _row("<image>ok", ["good.png"]),
        _row("<image><image>two tags", ["good.png"]),
        _row("<image>missing", ["nowhere.png"]),
        _row("<image>corrupt", ["corrupt.png"]),
        _row("<image>truncated png", ["truncated.png"]),
        _row("<image>inline", [inline]),
        _row("<image>truncated jpeg", ["truncated.jpg"]),
    ]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "run"
    assert run_sft(vlm_dirs("llava"), data, out, max_steps=1) == 1
    err = capsys.readouterr().err
    assert (
        f"{data}:2: the messages hold 2 <image> tag(s) but 'images' lists 1 image(s); put one "
        "<image> tag where each image goes in the conversation"
    ) in err
    assert (
        f"{data}:3: image 1 'nowhere.png' does not exist; relative paths are looked up in " in err
    )
    assert f"{data}:4: image 1 ({tmp_path / 'corrupt.png'}) is not an image PIL can read" in err
    assert f"{data}:5: image 1 ({tmp_path / 'truncated.png'}) is damaged: " in err
    assert f"{data}:7: image 1 ({jpeg}) is damaged: " in err
    assert "5 of 7 rows are invalid" in err
    assert f"{data}:1:" not in err and f"{data}:6:" not in err
    assert not (out / "metrics.jsonl").exists()


def _truncated_jpeg(path) -> None:
    """A JPEG cut in half: its header reads and verify() passes, its pixels do not decode."""
    import numpy as np
    from PIL import Image

    noise = np.random.RandomState(0).randint(0, 255, (64, 64, 3)).astype("uint8")
    Image.fromarray(noise).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_base64_images_train(vlm_dirs, tmp_path, capsys):
    """data URLs and bare base64 (ms-swift's two inline forms) train like files: also a
    JPEG's bare base64 ("/9j/...", like an absolute path) and one longer than a file name."""
    from PIL import Image

    png = vh.write_picture(tmp_path / "p.png", vh.COLOURS["green"], (64, 64)).read_bytes()
    Image.open(tmp_path / "p.png").save(tmp_path / "p.jpg", quality=90)
    encoded = base64.b64encode(png).decode()
    jpeg = base64.b64encode((tmp_path / "p.jpg").read_bytes()).decode()
    assert jpeg.startswith("/9j/") and max(len(piece) for piece in encoded.split("/")) > 255
    rows = [
        _row("<image>url", ["data:image/png;base64," + encoded]),
        _row("<image>bare", [encoded]),
        _row("<image>bare jpeg", [jpeg]),
    ]
    data = write_jsonl(tmp_path / "inline.jsonl", rows)
    out = tmp_path / "run"
    flags = dict(max_steps=1, per_device_train_batch_size=3, load_from_cache_file="false")
    assert run_sft(vlm_dirs("llava"), data, out, **flags) == 0
    assert "image preprocessing: 3 images in " in capsys.readouterr().out
    assert len(logged(out, "loss")) == 1


def test_cached_run_skips_image_preprocessing_and_says_so(vlm_dirs, tmp_path, capsys):
    rows = vh.colour_rows(tmp_path, 4)  # 4 tagged rows, one image-part row, one text-only
    # Data of this test only: the first run cannot find another test's cache entry.
    rows[-1]["messages"][0]["content"] = f"Say hello ({uuid.uuid4().hex})."
    data = write_jsonl(tmp_path / "colours.jsonl", rows)
    folder = vlm_dirs("qwen2_vl")
    flags = dict(max_steps=1, per_device_train_batch_size=2)
    assert run_sft(folder, data, tmp_path / "first", **flags) == 0
    first = capsys.readouterr().out
    assert "tokenized data in " in first
    lines = [line for line in first.splitlines() if line.startswith("image preprocessing")]
    assert len(lines) == 1
    assert lines[0].startswith("image preprocessing: 5 images in ")
    assert lines[0].endswith(" images/s) with Qwen2VLProcessor")
    rate = float(lines[0].split("(")[1].split(" images/s")[0])
    assert rate > 0

    # No image is decoded or processed again.
    untouched = mock.patch(
        "swiftlm.data.vision_encode.load_image", side_effect=AssertionError("decoded again")
    )
    with untouched:
        assert run_sft(folder, data, tmp_path / "second", **flags) == 0
    second = capsys.readouterr().out
    assert "tokenized data loaded from cache in " in second
    assert (
        "image preprocessing skipped: features of 5 images loaded from the tokenized-data cache"
    ) in second
    assert "images/s" not in second
    # Same samples either way: the same first-step loss.
    assert logged(tmp_path / "first", "loss") == logged(tmp_path / "second", "loss")

    # An image changed in place (same path, same data file): its features are encoded again.
    vh.write_picture(tmp_path / "picture0.png", vh.COLOURS["blue"], (60, 44), seed=9)
    assert run_sft(folder, data, tmp_path / "third", **flags) == 0
    third = capsys.readouterr().out
    assert f"{tmp_path / 'picture0.png'} changed since; re-encoding" in third
    assert "image preprocessing: 5 images in " in third


def test_truncation_never_cuts_an_image(vlm_dirs, tmp_path, capsys):
    """--truncation_strategy right: a sample whose cut reaches its image is deleted and
    counted, a sample whose cut only removes text after its image is truncated."""
    from swiftlm.data.vision_encode import encode_vision_samples
    from swiftlm.data.vision_rows import vision_chat_sample
    from swiftlm.models.vision import image_token_ids, load_processor

    folder = vlm_dirs("llava")
    vh.write_picture(tmp_path / "a.png", vh.COLOURS["red"])
    vh.write_picture(tmp_path / "b.png", vh.COLOURS["blue"])
    late = _row("Look very closely at the picture below, then answer. <image>", ["a.png"])
    early = _row("<image>Colour?", ["b.png"], "It is blue, a deep and quiet blue, like the sea.")
    data = write_jsonl(tmp_path / "data.jsonl", [late, early])

    # Where the image tokens lie, measured once without truncation.
    processor = load_processor(str(folder))
    image_ids = image_token_ids(processor)
    samples = []
    for row in (late, early):
        row = {**row, "images": [str(tmp_path / name) for name in row["images"]]}
        samples.append(vision_chat_sample(row, method="sft"))
    encoded, _, _ = encode_vision_samples(processor, samples, 4096, "right", "assistant", image_ids)
    first_image = [ids.index(next(i for i in ids if i in image_ids)) for ids in _ids(encoded)]
    last_image = max(k for k, i in enumerate(encoded[1]["input_ids"]) if i in image_ids)
    answer_start = encoded[1]["labels"].index(next(x for x in encoded[1]["labels"] if x >= 0))
    max_length = answer_start + 3
    assert last_image < answer_start < max_length <= first_image[0]
    assert max_length < len(encoded[1]["input_ids"])

    out = tmp_path / "run"
    flags = dict(max_steps=1, max_length=max_length, truncation_strategy="right")
    assert run_sft(folder, data, out, **flags) == 0
    printed = capsys.readouterr().out
    assert (
        f"--max_length {max_length} --truncation_strategy right: 1 deleted (truncation would "
        "cut an image), 1 truncated"
    ) in printed
    assert f"data: 1 sample, {max_length} tokens; " in printed
    assert f"1 truncated, 1 deleted at {max_length} tokens" in printed
    # The kept sample is cut to max_length: its image and 3 answer tokens.
    assert logged(out, "label_tokens") == [max_length - answer_start]


def _ids(encoded: list[dict]) -> list[list[int]]:
    return [sample["input_ids"] for sample in encoded]


def test_images_preprocessed_in_worker_processes_train_the_same(vlm_dirs, tmp_path, capsys):
    """--dataset_num_proc 2: chunks of the rows are preprocessed in two spawned processes;
    the encoded samples, and so the training, are those of one process."""
    rows = vh.colour_rows(tmp_path, 8)
    rows[-1]["messages"][0]["content"] = f"Say hello ({uuid.uuid4().hex})."
    data = write_jsonl(tmp_path / "colours.jsonl", rows)
    folder = vlm_dirs("llava")
    flags = dict(max_steps=2, per_device_train_batch_size=4, load_from_cache_file="false")
    assert run_sft(folder, data, tmp_path / "one", **flags) == 0
    assert run_sft(folder, data, tmp_path / "two", dataset_num_proc=2, **flags) == 0
    out = capsys.readouterr().out
    assert "image preprocessing: 9 images in " in out
    assert " images/s) with LlavaProcessor in 2 processes" in out
    assert logged(tmp_path / "two", "loss") == logged(tmp_path / "one", "loss")
