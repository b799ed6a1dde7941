"""Image preprocessing of vision-language SFT rows: swiftlm's encoding (checks, labels, the
processor) in the main process and in worker processes, against the processor alone in a plain
loop, and the cached re-read that later runs (and later epochs) cost.

    python benchmarks/vision_preprocessing.py --images 1200 --size 2048x1536

Rows are `<image>` questions about JPEG photographs made from scikit-image's `skimage.data`
(resized, rotated); the processor is LLaVA-1.5's (CLIP at 336 pixels) around SmolLM2's
tokenizer. Times are wall clock on this machine: compare the ratios, not the seconds.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path


def write_rows(folder: Path, count: int, size: tuple[int, int]) -> list[dict]:
    from PIL import Image
    from skimage import data

    photos = [data.astronaut(), data.chelsea(), data.coffee(), data.rocket()]
    distinct = min(count, 400)  # rows beyond this reuse files (decoding costs the same)
    for index in range(distinct):
        image = Image.fromarray(photos[index % len(photos)]).resize(size).rotate(index % 7)
        image.save(folder / f"photo{index}.jpg", quality=90)
    return [
        {
            "messages": [
                {"role": "user", "content": "<image>Which photograph is this?"},
                {"role": "assistant", "content": "The astronaut."},
            ],
            "images": [f"photo{index % distinct}.jpg"],
        }
        for index in range(count)
    ]


def llava_processor():
    """The demo's processor (scripts/vqa_demo.py) with LLaVA-1.5's image size, 336 pixels."""
    import importlib.util

    from transformers import CLIPImageProcessor

    script = Path(__file__).resolve().parents[1] / "scripts" / "vqa_demo.py"
    spec = importlib.util.spec_from_file_location("vqa_demo", script)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    processor = demo.build_processor(demo.smollm2_folder())
    processor.image_processor = CLIPImageProcessor()  # 336 pixels
    processor.patch_size = 14
    return processor


def timed(function) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1200)
    parser.add_argument("--size", default="2048x1536", help="photo size, WIDTHxHEIGHT")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))

    from PIL import Image

    from swiftlm.data.cache import load_or_encode
    from swiftlm.data.images import relative_to
    from swiftlm.data.vision_encode import encode_vision_samples
    from swiftlm.data.vision_rows import vision_chat_sample
    from swiftlm.models.vision import image_token_ids

    processor = llava_processor()
    image_ids = image_token_ids(processor)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = write_rows(folder, args.images, size)
        with relative_to(folder):
            check_s, samples = timed(lambda: [vision_chat_sample(r, method="sft") for r in rows])
        options = (4096, "delete", "assistant", image_ids)

        def encode(workers: int):
            return encode_vision_samples(processor, samples, *options, workers=workers)

        one_s, (encoded, _, _) = timed(lambda: encode(1))
        many_s, _ = timed(lambda: encode(args.workers))

        def processor_alone():
            for sample in samples:
                text = processor.apply_chat_template(sample["messages"], tokenize=False)
                image = Image.open(sample["messages"][0]["content"][0]["image"]).convert("RGB")
                processor(text=[text], images=[image], return_tensors="np")

        plain_s, _ = timed(processor_alone)
        cache = folder / "cache"
        columns = ("input_ids", "labels", "vision")
        length = lambda s: len(s["input_ids"])  # noqa: E731
        load_or_encode(
            cache, lambda: ({"train": encoded}, []), print, columns=columns, length=length
        )
        reread_s, splits = timed(
            lambda: [
                s["vision"]
                for s in load_or_encode(
                    cache, None, lambda _: None, columns=columns, length=length
                )["train"]
            ]
        )

    n = args.images
    table = {
        "row checks (header read + verify, JPEG decoded at 1/8)": check_s,
        "processor alone, plain loop (transformers)": plain_s,
        "swiftlm encoding, main process": one_s,
        f"swiftlm encoding, {args.workers} processes (start-up included)": many_s,
        "cached features re-read (a later run or epoch)": reread_s,
    }
    print(f"{n} photos of {size[0]}x{size[1]} JPEG, CLIPImageProcessor at 336 px")
    for name, seconds in table.items():
        print(f"  {name:<62} {seconds:7.2f} s  {n / seconds:8.1f} images/s")
    print(
        f"  encoding / processor alone: {one_s / plain_s:.2f}x; main process / {args.workers} "
        f"processes: {one_s / many_s:.2f}x; main process / cached re-read: {one_s / reread_s:.0f}x"
    )
    print(json.dumps({k: round(v, 3) for k, v in table.items()}))


if __name__ == "__main__":
    main()
