"""Offline vision-language demo: a tiny LLaVA built from real parts, trained on VQA about photos.

No registry package ships a small pretrained vision-language model, so this script builds one:
the packaged SmolLM2-135M-Instruct as the language model (weights copied exactly), a small CLIP
ViT and LLaVA's projector initialized from a fixed seed; and a visual question-answering set
from the photographs scikit-image ships (`skimage.data`: astronaut, chelsea the cat, coffee ...):
"Which picture is this?" about random crops, scored on other crops the training never saw. The
recipe trains the encoder and projector first with the language model frozen, then LoRA on the
language model, as LLaVA does.

    python scripts/vqa_demo.py recipe /tmp/vqa          # prints every command below
    python scripts/vqa_demo.py recipe /tmp/vqa --run    # runs them, timed, and scores

`build-model` and `build-data` write the model and the rows, two `swiftlm sft` runs train,
`swiftlm infer` answers the held-out questions and `score` compares them with the answers;
`predict` answers with plain transformers instead (a cross-check of `swiftlm infer`).

Needs scikit-image (`pip install scikit-image`) for the photographs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# skimage.data loader -> the one-word answer to "Which picture is this?".
PHOTOS = {
    "astronaut": "astronaut",
    "chelsea": "cat",
    "coffee": "coffee",
    "rocket": "rocket",
    "coins": "coins",
    "camera": "cameraman",
    "moon": "moon",
    "page": "page",
    "horse": "horse",
    "hubble_deep_field": "galaxies",
    "immunohistochemistry": "cells",
    "retina": "retina",
}
QUESTION = "Which picture is this? Answer with one word."
IMAGE_TOKEN = "<image>"
SEED = 1234
# The vision encoder: a CLIP ViT small enough to train from scratch on 2 CPU cores. 64x64 pixel
# inputs in 16x16 patches give 16 image tokens (the class token is dropped), so a question is
# about 60 tokens long.
VISION = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=3, num_attention_heads=3)
IMAGE_SIZE, PATCH_SIZE = 64, 16
# SmolLM2's ChatML template, with OpenAI-style content lists whose image parts render as <image>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------------- the model


def smollm2_folder() -> Path:
    """The Hugging Face folder of the packaged SmolLM2-135M-Instruct (converted once)."""
    from swiftlm.models.loader import resolve_model

    return Path(resolve_model(None).path)


def build_processor(lm_folder: Path):
    """SmolLM2's tokenizer plus <image>, a CLIP image processor and the image chat template."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(lm_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
        chat_template=CHAT_TEMPLATE,
    )


def build_model(out: Path) -> Path:
    """Save a LLaVA folder: SmolLM2's exact weights + a seeded CLIP encoder and projector."""
    import torch
    import transformers as tf

    lm_folder = smollm2_folder()
    processor = build_processor(lm_folder)
    tokenizer = processor.tokenizer
    text_config = tf.AutoConfig.from_pretrained(lm_folder)
    vision = tf.CLIPVisionConfig(**VISION, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = tf.LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    torch.manual_seed(SEED)
    model = tf.LlavaForConditionalGeneration(config)
    lm = tf.AutoModelForCausalLM.from_pretrained(lm_folder, dtype=torch.float32)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as SmolLM2's
    model.resize_token_embeddings(len(tokenizer))
    model.config.text_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.text_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    shutil.copy(lm_folder / "generation_config.json", out)  # SmolLM2's ids for generate
    check_model(out, lm, tokenizer)
    return out


def check_model(folder: Path, lm, tokenizer) -> None:
    """The folder loads as an image-text-to-text model, and text-only logits equal SmolLM2's."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        vlm = model(input_ids=ids, output_hidden_states=True)
        text = lm(input_ids=ids, output_hidden_states=True)
    # The decoder's output is bit-identical; the head's matmul over one more vocabulary row
    # may round differently in the last bits, so logits are compared with a tolerance.
    same_hidden = torch.equal(vlm.hidden_states[-1], text.hidden_states[-1])
    difference = (vlm.logits[..., : lm.config.vocab_size] - text.logits).abs().max().item()
    if not same_hidden or difference > 1e-2:
        raise SystemExit(f"text-only outputs differ from SmolLM2's (logits by {difference})")
    trained = sum(p.numel() for p in model.parameters())
    print(
        f"{folder}: {type(model).__name__} ({trained / 1e6:.1f}M parameters), "
        f"{type(processor).__name__}; text-only: hidden states equal SmolLM2's, logits within "
        f"{difference:.1e}"
    )


# ----------------------------------------------------------------------------------- the data


def load_photo(name: str) -> np.ndarray:
    """An skimage.data photograph as uint8 RGB (grey and binary ones replicated)."""
    import skimage.data

    pixels = np.asarray(getattr(skimage.data, name)())
    if pixels.dtype == bool:
        pixels = pixels.astype(np.uint8) * 255
    if pixels.ndim == 2:
        pixels = np.stack([pixels] * 3, axis=-1)
    return pixels[..., :3].astype(np.uint8)


def random_crop(photo: np.ndarray, rng: np.random.Generator, size: int):
    """A square crop covering 40-100% of the shorter side, maybe mirrored, resized to `size`."""
    from PIL import Image

    height, width = photo.shape[:2]
    side = int(min(height, width) * rng.uniform(0.4, 1.0))
    top = int(rng.integers(0, height - side + 1))
    left = int(rng.integers(0, width - side + 1))
    crop = Image.fromarray(photo[top : top + side, left : left + side])
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return crop.resize((size, size), Image.Resampling.BICUBIC)


def vqa_row(image: str, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": IMAGE_TOKEN + QUESTION},
            {"role": "assistant", "content": answer},
        ],
        "images": [image],
    }


def write_split(out: Path, split: str, per_photo: int, seed: int, size: int) -> list[dict]:
    """`per_photo` crops of every photo under out/images/<split>/, one row each (shuffled)."""
    rng = np.random.default_rng(seed)
    folder = out / "images" / split
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, answer in PHOTOS.items():
        photo = load_photo(name)
        for index in range(per_photo):
            path = folder / f"{name}-{index:03d}.png"
            random_crop(photo, rng, size).save(path)
            rows.append(vqa_row(str(path.relative_to(out)), answer))
    rng.shuffle(rows)
    write_jsonl(out / f"{split}.jsonl", rows)
    return rows


def chance_levels(rows: list[dict]) -> dict:
    answers = [answer_of(row) for row in rows]
    counts = {a: answers.count(a) for a in sorted(set(answers))}
    return {
        "classes": len(counts),
        "uniform_chance": 1 / len(counts),
        "majority_rate": max(counts.values()) / len(answers),
        "counts": counts,
    }


def build_data(out: Path, train_per_photo=40, heldout_per_photo=10, size=96) -> dict:
    """train.jsonl and heldout.jsonl (different random crops: seeds differ), and the chance."""
    out.mkdir(parents=True, exist_ok=True)
    train = write_split(out, "train", train_per_photo, SEED, size)
    heldout = write_split(out, "heldout", heldout_per_photo, SEED + 1, size)
    # `swiftlm infer --val_dataset` takes the held-out rows without their answers.
    prompts = [{"messages": row["messages"][:1], "images": row["images"]} for row in heldout]
    write_jsonl(out / "heldout_prompts.jsonl", prompts)
    summary = {"train": len(train), "heldout": len(heldout), **chance_levels(heldout)}
    (out / "chance.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{out}: {len(train)} training and {len(heldout)} held-out questions about "
        f"{len(PHOTOS)} photos; chance {summary['uniform_chance']:.1%} (1/{len(PHOTOS)}), "
        f"majority class {summary['majority_rate']:.1%}"
    )
    return summary


# ------------------------------------------------------------------------ predicting, scoring


def resolve_final(path: Path) -> Path:
    """A run directory's final/ folder, or the folder itself."""
    return path / "final" if (path / "final").is_dir() else path


def load_trained(path: Path, dtype: str = "float32"):
    """(model, processor) of a full-model folder or a LoRA adapter folder (merged into its base)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = resolve_final(path)
    torch_dtype = getattr(torch, dtype)
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        from peft import PeftModel

        base = json.loads(adapter.read_text())["base_model_name_or_path"]
        model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch_dtype)
        model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    else:
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch_dtype)
    processor = AutoProcessor.from_pretrained(folder)  # swiftlm saves it next to the weights
    processor.tokenizer.padding_side = "left"
    return model.eval(), processor


def predict(path: Path, rows_file: Path, out: Path, batch_size=16, dtype="float32") -> list:
    """Greedy answers to every row's first user turn (images relative to its JSONL)."""
    import torch
    from PIL import Image

    model, processor = load_trained(path, dtype)
    rows = read_jsonl(rows_file)
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        texts = [
            processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
            for row in batch
        ]
        images = [Image.open(rows_file.parent / row["images"][0]).convert("RGB") for row in batch]
        inputs = processor(images=images, text=texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(
                **inputs, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )
        new = ids[:, inputs["input_ids"].shape[1] :]
        answers += processor.tokenizer.batch_decode(new, skip_special_tokens=True)
    write_jsonl(out, [{"response": answer.strip()} for answer in answers])
    print(f"{out}: {len(answers)} answers")
    return answers


def first_word(text: str) -> str:
    words = re.findall(r"[a-z]+", text.lower())
    return words[0] if words else ""


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion."""
    if total == 0:
        return 0.0, 0.0
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def score(predictions: Path, heldout: Path) -> dict:
    """Accuracy (first word, lower case) of predictions (`response`) against held-out answers."""
    answers = [answer_of(row) for row in read_jsonl(heldout)]
    responses = [row.get("response", "") for row in read_jsonl(predictions)]
    if len(responses) != len(answers):
        raise SystemExit(f"{predictions}: {len(responses)} predictions for {len(answers)} rows")
    hits = [first_word(r) == first_word(a) for r, a in zip(responses, answers, strict=True)]
    correct = sum(hits)
    low, high = wilson_interval(correct, len(hits))
    per_class = {}
    for answer, hit in zip(answers, hits, strict=True):
        per_class.setdefault(answer, []).append(hit)
    result = {
        "accuracy": correct / len(hits),
        "correct": correct,
        "total": len(hits),
        "ci95": [low, high],
        **{k: v for k, v in chance_levels(read_jsonl(heldout)).items() if k != "counts"},
        "per_class": {a: sum(h) / len(h) for a, h in sorted(per_class.items())},
    }
    out = predictions.with_suffix(".score.json")
    out.write_text(json.dumps(result, indent=1))
    print(
        f"held-out accuracy {result['accuracy']:.1%} ({correct}/{len(hits)}, 95% CI "
        f"{low:.1%}-{high:.1%}); chance {result['uniform_chance']:.1%}, majority class "
        f"{result['majority_rate']:.1%}  -> {out}"
    )
    return result


# ---------------------------------------------------------------------------------- the recipe

SCRIPT = Path(__file__).resolve()
SCRIPT_NAME = "scripts/vqa_demo.py"  # as docs/vision.md runs it, from the repository root
# Stage 1 (LLaVA's alignment): the language model frozen, the new encoder and projector trained
# in full. Stage 2: LoRA on the language model with the projector trained in full, from
# stage 1's weights (the encoder frozen: --freeze_vit defaults to true).
STAGE1 = "--train_type full --freeze_llm true --freeze_vit false --freeze_aligner false "
STAGE1 += "--learning_rate 2e-3 --num_train_epochs 2"
STAGE2 = "--train_type lora --freeze_aligner false --learning_rate 5e-4 --num_train_epochs 1"
COMMON = "--warmup_ratio 0.1 --per_device_train_batch_size 16 --report_to none "
COMMON += "--overwrite_output_dir"


def recipe(work: Path, swiftlm="swiftlm", python="python", script=SCRIPT) -> list[tuple]:
    """(step name, argv) of the whole demo under `work`."""
    model, data, runs = work / "model", work / "data", work / "runs"
    answers = runs / "stage2" / "heldout_answers.jsonl"
    train = f"--dataset {data}/train.jsonl {COMMON}"
    heldout = f"--val_dataset {data}/heldout_prompts.jsonl --max_new_tokens 8"
    steps = {
        "build-model": f"{python} {script} build-model {model}",
        "build-data": f"{python} {script} build-data {data}",
        "stage1": f"{swiftlm} sft --model {model} {STAGE1} {train} --output_dir {runs}/stage1",
        "stage2": f"{swiftlm} sft --model {runs}/stage1/final {STAGE2} {train} "
        f"--output_dir {runs}/stage2",
        "infer": f"{swiftlm} infer --ckpt_dir {runs}/stage2 {heldout} --result_path {answers}",
        "score": f"{python} {script} score {answers} {data}/heldout.jsonl",
    }
    return [(name, shlex.split(line)) for name, line in steps.items()]


def run_recipe(work: Path) -> dict:
    """Run every step (swiftlm as `python -m swiftlm`), print wall times; the score, timed."""
    timings = {}
    for name, argv in recipe(work, f"{sys.executable} -m swiftlm", sys.executable):
        print(f"$ {shlex.join(argv)}", flush=True)
        start = time.perf_counter()
        subprocess.run(argv, check=True)
        timings[name] = round(time.perf_counter() - start, 1)
    result = json.loads((work / "runs/stage2/heldout_answers.score.json").read_text())
    result["wall_s"] = {**timings, "total": round(sum(timings.values()), 1)}
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(f"wall times (s): {result['wall_s']}")
    return result


# --------------------------------------------------------------------------------- utilities


def answer_of(row: dict) -> str:
    return next(m["content"] for m in reversed(row["messages"]) if m["role"] == "assistant")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))


COMMANDS = {
    "build-model": (["out"], "save the tiny LLaVA folder"),
    "build-data": (["out"], "write the VQA rows and crops"),
    "predict": (["model", "rows", "out"], "greedy answers of a run or folder (transformers)"),
    "score": (["predictions", "heldout"], "held-out accuracy of `response`s, with chance"),
    "recipe": (["work"], "print the whole demo's commands under WORK (--run: run them)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (positionals, text) in COMMANDS.items():
        command = commands.add_parser(name, help=text)
        for positional in positionals:
            command.add_argument(positional, type=Path)
    commands.choices["recipe"].add_argument("--run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "build-model":
        build_model(args.out)
    elif args.command == "build-data":
        build_data(args.out)
    elif args.command == "predict":
        predict(args.model, args.rows, args.out)
    elif args.command == "score":
        score(args.predictions, args.heldout)
    elif args.run:
        run_recipe(args.work)
    else:
        print("\n".join(shlex.join(argv) for _, argv in recipe(args.work, script=SCRIPT_NAME)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
