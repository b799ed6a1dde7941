"""Vision data: encoding through each tiny model's processor (image tokens never carry loss,
as many image tokens as the processor expands), label transfer and truncation on their own,
image references and --max_pixels."""

import base64
import io

import numpy as np
import pytest

import vlm_helpers as vh
from swiftlm.data.encode import IGNORE_INDEX, TruncationReport
from swiftlm.data.images import load_image, resolve_image
from swiftlm.data.rows import RowError
from swiftlm.data.vision_batch import collate_image_features, features_of, pack_features
from swiftlm.data.vision_encode import (
    IMAGE_CUT,
    encode_vision_samples,
    expand_labels,
    truncate_vision,
)
from swiftlm.data.vision_rows import vision_chat_sample
from swiftlm.errors import DataError

IMG = 900  # an image token id of the synthetic samples


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    """swiftlm's processor of each tiny folder (load_processor), built when first asked for."""
    from swiftlm.models import vision

    built = {}

    def get(arch: str):
        if arch not in built:
            folder = vh.BUILDERS[arch](tmp_path_factory.mktemp(f"tiny-{arch}"))
            with vh.patched_qwen2_vl_loading():  # Qwen2-VL's without torchvision
                built[arch] = vision.load_processor(str(folder))
        return built[arch]

    return get


def _sample(content, images, answer="It is red."):
    row = {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    }
    if images:
        row["images"] = [str(p) for p in images]
    return vision_chat_sample(row, method="sft")


def _encode(processor, samples, max_length=4096, strategy="right", max_pixels=0):
    from swiftlm.models.vision import image_token_ids

    image_ids = image_token_ids(processor)
    encoded, report, throughput = encode_vision_samples(
        processor, samples, max_length, strategy, "assistant", image_ids, max_pixels
    )
    return encoded, report, throughput, image_ids


def _expected_image_tokens(arch: str, processor, features, images: int) -> int:
    """The image tokens the model consumes for these features."""
    if arch == "llava":  # one per 14x14 patch of the 28x28 crop (CLS dropped: "default")
        return images * (28 // 14) ** 2
    if arch == "qwen2_vl":  # one per 2x2 merged patches
        grid = features["image_grid_thw"].numpy()
        assert grid.shape == (images, 3)
        assert features["pixel_values"].shape[0] == int(grid.prod(axis=1).sum())
        return int(grid.prod(axis=1).sum()) // 4
    # idefics3: image_seq_len per crop (the crops of every image, and each global image)
    crops = features["pixel_values"].shape[1]
    assert crops >= images
    return processor.image_seq_len * crops


@pytest.mark.parametrize("arch", vh.ARCHITECTURES)
def test_image_tokens_never_carry_loss(processors, arch, tmp_path):
    processor = processors(arch)
    red = vh.write_picture(tmp_path / "red.png", vh.COLOURS["red"], (40, 32))
    blue = vh.write_picture(tmp_path / "blue.png", vh.COLOURS["blue"], (90, 30), seed=1)
    part = {"type": "image_url", "image_url": {"url": str(blue)}}
    samples = [
        _sample("<image>What colour is this?", [red]),
        _sample("Compare <image> with <image>, please.", [red, blue], "Red, then blue."),
        _sample([part, {"type": "text", "text": "And this?"}], [], "Blue."),
        _sample("Say hello.", [], "Hello."),
    ]
    encoded, _, throughput, image_ids = _encode(processor, samples)
    assert len(encoded) == 4
    assert throughput.images == 4
    answers = ["It is red.", "Red, then blue.", "Blue.", "Hello."]
    image_counts = [1, 2, 1, 0]
    tokenizer = processor.tokenizer
    for sample, answer, images in zip(encoded, answers, image_counts, strict=True):
        ids, labels = sample["input_ids"], sample["labels"]
        assert len(ids) == len(labels)
        features = features_of(sample)
        # No label on any image token; the image tokens are those the processor expands.
        assert all(
            label == IGNORE_INDEX for i, label in zip(ids, labels, strict=True) if i in image_ids
        )
        count = sum(1 for i in ids if i == processor.image_token_id)
        if images:
            assert count == _expected_image_tokens(arch, processor, features, images) > 0
        else:
            assert count == 0 and "pixel_values" not in features
        # Exactly the answer and its end-of-turn token carry labels, as one run.
        marked = [k for k, label in enumerate(labels) if label != IGNORE_INDEX]
        assert marked == list(range(marked[0], marked[-1] + 1))
        assert [labels[k] for k in marked] == [ids[k] for k in marked]
        assert tokenizer.decode([ids[k] for k in marked]) == answer + "<|im_end|>"


@pytest.mark.parametrize("arch", vh.ARCHITECTURES)
def test_an_image_inside_a_trained_answer_is_not_trained(processors, arch, tmp_path):
    """The answer's text around the image trains; the image's tokens (and what the processor
    inserts around them: Idefics3's crop grid, Qwen2-VL's vision start/end) do not."""
    processor = processors(arch)
    red = vh.write_picture(tmp_path / "red.png", vh.COLOURS["red"], (40, 32))
    [sample], _, _, image_ids = _encode(
        processor, [_sample("Show me red.", [red], "Here it is: <image> A red square.")]
    )
    ids, labels = sample["input_ids"], sample["labels"]
    assert sum(1 for i in ids if i == processor.image_token_id) > 0
    marked = [ids[k] for k, label in enumerate(labels) if label != IGNORE_INDEX]
    assert not set(marked) & image_ids
    assert processor.tokenizer.decode(marked) == "Here it is:  A red square.<|im_end|>"


@pytest.mark.parametrize("arch", vh.ARCHITECTURES)
def test_encoded_ids_are_the_processors_own(processors, arch, tmp_path):
    """The processor's own chat template and call give the same ids and pixel features."""
    from PIL import Image

    processor = processors(arch)
    picture = vh.write_picture(tmp_path / "p.png", vh.COLOURS["green"], (52, 36))
    [sample], _, _, _ = _encode(processor, [_sample("<image>Colour?", [picture], "Green.")])
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Green."}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    with Image.open(picture) as image:
        reference = processor(text=[text], images=[image.convert("RGB")], return_tensors="np")
    assert sample["input_ids"] == reference["input_ids"][0].tolist()
    features = features_of(sample)
    np.testing.assert_array_equal(features["pixel_values"].numpy(), reference["pixel_values"])


def test_expand_labels_carries_labels_over_inserted_image_tokens():
    plain = [1, 2, IMG, 3, 4]
    labels = [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 3, 4]
    expanded = [1, 2, 800, IMG, IMG, IMG, 801, 3, 4]
    assert expand_labels(plain, labels, expanded, {IMG}) == [IGNORE_INDEX] * 7 + [3, 4]
    # An image token inside a trained span is still never trained.
    assert expand_labels([IMG, 3], [IMG, 3], [IMG, IMG, 3], {IMG}) == [IGNORE_INDEX] * 2 + [3]


def test_expand_labels_refuses_a_processor_that_changes_trained_text():
    with pytest.raises(DataError, match=r"the processor changed 1 trained token\(s\)"):
        expand_labels(
            [1, IMG, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 3, 4], [1, IMG, IMG, 3, 5], {IMG}
        )


def _synthetic(length=8, image_at=(2, 3)):
    """ids 10, 11, ... with image tokens at `image_at`; the last 3 tokens are labelled."""
    ids = [IMG if k in image_at else 10 + k for k in range(length)]
    labels = [IGNORE_INDEX] * (length - 3) + ids[-3:]
    types = np.array([[1 if k in image_at else 0 for k in range(length)]])
    return {"input_ids": ids, "labels": labels, "features": {"mm_token_type_ids": types}}


def test_truncation_cuts_text_after_the_image():
    report = TruncationReport("right", 6)
    kept = truncate_vision(_synthetic(), 6, "right", report, {IMG})
    assert kept["input_ids"] == [10, 11, IMG, IMG, 14, 15]
    assert kept["labels"] == [IGNORE_INDEX] * 5 + [15]
    # Token-aligned features are cut like the tokens.
    assert features_of(kept)["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0]]
    assert report.counts == {"truncated": 1}


@pytest.mark.parametrize(("strategy", "max_length"), [("right", 3), ("right", 2), ("left", 5)])
def test_truncation_that_would_cut_an_image_deletes_the_sample(strategy, max_length):
    report = TruncationReport(strategy, max_length)
    assert truncate_vision(_synthetic(), max_length, strategy, report, {IMG}) is None
    assert report.counts == {IMAGE_CUT: 1}
    assert report.as_dict()["deleted"] == 1
    assert f"1 {IMAGE_CUT}" in report.summary()


def test_left_truncation_before_the_image_keeps_it():
    report = TruncationReport("left", 6)
    kept = truncate_vision(_synthetic(image_at=(4, 5)), 6, "left", report, {IMG})
    assert kept["input_ids"] == [12, 13, IMG, IMG, 16, 17]
    assert report.counts == {"truncated": 1}


@pytest.mark.parametrize("strategy", ["right", "left"])
def test_truncation_of_qwen2_vl_never_removes_an_images_delimiters(processors, tmp_path, strategy):
    """A cut that keeps every <|image_pad|> but drops the image's <|vision_end|> (right) or
    <|vision_start|> (left, by which Qwen2-VL finds its images) deletes the sample."""
    processor = processors("qwen2_vl")
    picture = vh.write_picture(tmp_path / "p.png", vh.COLOURS["red"])
    row = {
        "messages": [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "<image>"},
            {"role": "assistant", "content": "Red."},
        ],
        "images": [str(picture)],
    }
    [full], _, _, image_ids = _encode(processor, [vision_chat_sample(row, method="sft")])
    ids = full["input_ids"]
    tokens = processor.tokenizer.convert_tokens_to_ids
    if strategy == "right":  # keep up to the last pad
        max_length = ids.index(tokens("<|vision_end|>"))
        assert ids[max_length - 1] == processor.image_token_id
    else:  # keep from the first pad
        max_length = len(ids) - ids.index(tokens("<|vision_start|>")) - 1
        assert ids[len(ids) - max_length] == processor.image_token_id
    report = TruncationReport(strategy, max_length)
    item = {**full, "features": {k: v.numpy() for k, v in features_of(full).items()}}
    assert truncate_vision(item, max_length, strategy, report, image_ids) is None
    assert report.counts == {IMAGE_CUT: 1}


def test_encoding_counts_deleted_samples_and_stops_when_none_is_left(processors, tmp_path):
    processor = processors("llava")
    picture = vh.write_picture(tmp_path / "p.png", vh.COLOURS["red"])
    late = _sample("Look at this picture very carefully before you answer me. <image>", [picture])
    text_only = _sample("Hi.", [])
    [short], *_ = _encode(processor, [text_only])
    max_length = len(short["input_ids"])
    encoded, report, _, image_ids = _encode(processor, [late, text_only], max_length=max_length)
    assert [sample["input_ids"] for sample in encoded] == [short["input_ids"]]
    assert report.counts == {IMAGE_CUT: 1}
    with pytest.raises(
        DataError, match=f"no sample is left to train on with --max_length {max_length}"
    ):
        _encode(processor, [late], max_length=max_length)


def test_max_pixels_scales_a_large_image_down(tmp_path):
    picture = vh.write_picture(tmp_path / "big.png", vh.COLOURS["blue"], (400, 300))
    assert load_image(str(picture)).size == (400, 300)
    small = load_image(str(picture), max_pixels=10_000)
    width, height = small.size
    assert width * height <= 10_000
    assert (width, height) == (115, 86)  # aspect kept: sqrt(10000 / 120000) of each side
    assert small.mode == "RGB"
    assert load_image(str(picture), max_pixels=200 * 200 * 4).size == (400, 300)


def test_max_pixels_gives_qwen2_vl_fewer_image_tokens_and_a_new_cache_key(processors, tmp_path):
    from swiftlm.data.cache import cache_key
    from swiftlm.methods.vision import VisionInputs

    processor = processors("qwen2_vl")
    picture = vh.write_picture(tmp_path / "big.png", vh.COLOURS["blue"], (200, 200))
    sample = _sample("<image>Colour?", [picture], "Blue.")

    def image_tokens(max_pixels: int) -> int:
        [encoded], *_ = _encode(processor, [sample], max_pixels=max_pixels)
        return encoded["input_ids"].count(processor.image_token_id)

    assert image_tokens(0) == 16  # the processor's own limit: 28 * 28 * 16 pixels
    assert image_tokens(56 * 56) == 4  # 56x56: 2x2 merged patches
    keys = {
        pixels: cache_key(
            [], VisionInputs(processor, "qwen2_vl", pixels).cache_options(), processor.tokenizer
        )
        for pixels in (0, 56 * 56)
    }
    assert keys[0] != keys[56 * 56]
    same = VisionInputs(processor, "qwen2_vl", 0).cache_options()
    assert cache_key([], same, processor.tokenizer) == keys[0]


def test_cache_key_follows_the_processors_own_settings(processors, tmp_path):
    """Idefics3's image_seq_len (the processor's, not its image processor's) sets how many
    tokens an image becomes: another value is another tokenized-data cache entry."""
    import copy

    from swiftlm.data.cache import cache_key
    from swiftlm.methods.vision import VisionInputs

    processor = processors("idefics3")
    longer = copy.copy(processor)
    longer.image_seq_len = 9
    picture = vh.write_picture(tmp_path / "p.png", vh.COLOURS["red"])
    sample = _sample("<image>Colour?", [picture])
    counts = [
        _encode(p, [sample])[0][0]["input_ids"].count(p.image_token_id) for p in (processor, longer)
    ]
    assert counts[1] == counts[0] // 4 * 9
    keys = [
        cache_key([], VisionInputs(p, "idefics3").cache_options(), p.tokenizer)
        for p in (processor, longer)
    ]
    assert keys[0] != keys[1]


def encoded(blob: bytes, tokens: int = 3) -> dict:
    return {"input_ids": [1] * tokens, "vision": blob}


def test_idefics3_batches_pad_missing_crops_with_zero_images():
    crops = [np.ones((1, n, 3, 4, 4), dtype=np.float32) for n in (2, 5)]
    rows = [[encoded(pack_features({"pixel_values": c}))] for c in crops] + [[encoded(b"")]]
    batch = collate_image_features(rows, 7, ("pixel_values",))
    assert batch["pixel_values"].shape == (3, 5, 3, 4, 4)
    assert batch["pixel_values"][0, :2].eq(1).all() and batch["pixel_values"][0, 2:].eq(0).all()
    assert batch["pixel_values"][2].eq(0).all()
    # Packed: a row's samples put their crops one after another.
    packed = collate_image_features([[r[0] for r in rows]], 9, ("pixel_values",))
    assert packed["pixel_values"].shape == (1, 7, 3, 4, 4)
    # Features of the other models are concatenated (Qwen2-VL: patches of every image).
    patches = [
        [encoded(pack_features({"pixel_values": np.ones((n, 6), dtype=np.float32)}))]
        for n in (4, 8)
    ]
    assert collate_image_features(patches, 7)["pixel_values"].shape == (12, 6)


def test_token_aligned_features_follow_packed_rows():
    """A packed row's mm_token_type_ids are its samples' one after another; a text-only
    sample's tokens are text (0), so the image tokens stay where input_ids has them."""
    image = encoded(pack_features({"mm_token_type_ids": np.array([[0, 1, 1, 0]])}), 4)
    text = encoded(b"", 2)
    batch = collate_image_features([[text, image, text], [image]], 10)
    assert batch["mm_token_type_ids"].tolist() == [
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    ]


def test_image_references_inline_and_damaged(tmp_path):
    png = vh.write_picture(tmp_path / "p.png", vh.COLOURS["red"]).read_bytes()
    encoded = base64.b64encode(png).decode()
    url = "data:image/png;base64," + encoded
    assert resolve_image(url, "image 1") == url
    assert resolve_image(encoded, "image 1") == "data:image;base64," + encoded
    assert load_image(url).size == load_image(str(tmp_path / "p.png")).size == (40, 32)
    assert resolve_image(f"file://{tmp_path / 'p.png'}", "image 1") == str(tmp_path / "p.png")
    # Bare base64 of a JPEG starts with "/" ("/9j/"), like an absolute path.
    from PIL import Image

    jpeg = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 200, dtype="uint8")).save(jpeg, format="JPEG")
    bare_jpeg = base64.b64encode(jpeg.getvalue()).decode()
    assert bare_jpeg.startswith("/9j/")
    assert resolve_image(bare_jpeg, "image 1") == "data:image;base64," + bare_jpeg
    assert load_image("data:image;base64," + bare_jpeg).size == (8, 8)
    # A long one: runs of base64 longer than a file name can be (255) are no path.
    noise = np.random.RandomState(0).randint(0, 255, (64, 64, 3)).astype("uint8")
    big = io.BytesIO()
    Image.fromarray(noise).save(big, format="PNG")
    bare_png = base64.b64encode(big.getvalue()).decode()
    assert max(len(piece) for piece in bare_png.split("/")) > 255
    assert resolve_image(bare_png, "image 1") == "data:image;base64," + bare_png
    with pytest.raises(RowError, match=r"image 1 '/data/images/cat\.png' does not exist"):
        resolve_image("/data/images/cat.png", "image 1")
    with pytest.raises(RowError, match="image 2 has invalid base64 in its data URL"):
        resolve_image("data:image/png;base64,@@@", "image 2")
    # A JPEG cut in half: verify() passes it, its pixels do not decode.
    noise = np.random.RandomState(0).randint(0, 255, (64, 64, 3)).astype("uint8")
    Image.fromarray(noise).save(tmp_path / "full.jpg", quality=95)
    data = (tmp_path / "full.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    assert resolve_image(str(tmp_path / "full.jpg"), "image 1") == str(tmp_path / "full.jpg")
    with pytest.raises(
        RowError, match=r"image 1 \(.*cut.jpg\) is damaged: image file is truncated"
    ):
        resolve_image(str(tmp_path / "cut.jpg"), "image 1")
