"""DPO on a vision-language model: pairs with images, each side's log-probs equal to what
transformers computes on the same processed inputs, and rejected_images used for the
rejected side."""

import json

import pytest
import torch

from conftest import write_jsonl
from swiftlm.cli.main import main
from vlm_helpers import build_llava, write_picture

QUESTION = "<image>What colour is this?"


def pair(image: str, chosen: str, rejected: str, rejected_image: str | None = None) -> dict:
    row = {
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": chosen},
        ],
        "rejected_response": rejected,
        "images": [image],
    }
    if rejected_image is not None:
        row["rejected_messages"] = [row["messages"][0], {"role": "assistant", "content": rejected}]
        row["rejected_images"] = [rejected_image]
        del row["rejected_response"]
    return row


def answer_logp(model, processor, image_path, answer: str) -> float:
    """Sum of log-probs of the answer tokens (up to its end-of-turn token), from transformers
    alone: the answer is what the full conversation adds to the prompt with its generation
    prompt."""
    from PIL import Image

    user = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}],
        }
    ]
    prompt = processor.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = processor.apply_chat_template(
        [*user, {"role": "assistant", "content": answer}], tokenize=False
    )
    image = Image.open(image_path).convert("RGB")
    prompt_ids = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"][0]
    inputs = processor(text=[full], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert torch.equal(ids[: len(prompt_ids)], prompt_ids)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    last = len(prompt_ids) + ids[len(prompt_ids) :].tolist().index(end)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    logps = torch.log_softmax(logits[:-1], -1)
    targets = range(len(prompt_ids), last + 1)
    return float(sum(logps[t - 1, ids[t]] for t in targets))


@pytest.mark.parametrize("rejected_image", [False, True])
def test_dpo_logps_equal_transformers(tmp_path, rejected_image):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = build_llava(tmp_path / "llava")
    red = write_picture(tmp_path / "red.png", (220, 20, 20), seed=1)
    blue = write_picture(tmp_path / "blue.png", (20, 20, 220), (44, 30), seed=2)
    rows = [
        pair("red.png", "It is red.", "It is blue.", "blue.png" if rejected_image else None),
        pair("blue.png", "Blue.", "Red, I think."),
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "run"
    flags = ["--rlhf_type", "dpo", "--model", str(model_dir), "--dataset", str(data)]
    flags += ["--output_dir", str(out), "--max_steps", "1", "--torch_dtype", "float32"]
    flags += ["--per_device_train_batch_size", "2", "--lora_dropout", "0", "--logging_steps", "1"]
    assert main(["rlhf", *flags]) == 0
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    chosen = [
        answer_logp(model, processor, red, "It is red."),
        answer_logp(model, processor, blue, "Blue."),
    ]
    rejected = [
        answer_logp(model, processor, blue if rejected_image else red, "It is blue."),
        answer_logp(model, processor, blue, "Red, I think."),
    ]
    assert step["logps/chosen"] == pytest.approx(sum(chosen) / 2, abs=1e-4)
    assert step["logps/rejected"] == pytest.approx(sum(rejected) / 2, abs=1e-4)
    # At step 1 the policy is the reference: every reward is 0 and the loss is log 2.
    assert step["loss"] == pytest.approx(0.693147, abs=1e-5)
