"""DPO on a vision-language model: pairs with images, each side's log-probs equal to what
transformers computes on the same processed inputs, and rejected_images used for the
rejected side."""

import json
import math

import pytest
import torch

from conftest import write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, forward_terms
from vlm_helpers import build_llava, write_picture

# A row here (4 image patches and a short question and answer) is shorter than 64 tokens
# (answer_logp checks it); the image tower before the text model (2 layers, 32 wide) has the
# shorter chain, so twice the text model's covers both.
TERMS = 2 * forward_terms(tokens=64)

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
    assert len(ids) < 64  # TERMS
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    last = len(prompt_ids) + ids[len(prompt_ids) :].tolist().index(end)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    logps = torch.log_softmax(logits[:-1], -1)
    targets = range(len(prompt_ids), last + 1)
    return float(sum(logps[t - 1, ids[t]] for t in targets))


@pytest.mark.numerics
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
    # A padded batch of 2 against each conversation alone: means of sums of log-probs.
    assert_close(step["logps/chosen"], sum(chosen) / 2, terms=TERMS, what="chosen log-probs")
    assert_close(step["logps/rejected"], sum(rejected) / 2, terms=TERMS, what="rejected")
    # At step 1 the policy is the reference (LoRA's B is 0: the adapter adds exact zeros): every
    # reward is exactly 0, and only the float32 log-sigmoid of 0 and the mean round.
    assert_close(step["loss"], math.log(2), terms=3, what="step-1 loss")
