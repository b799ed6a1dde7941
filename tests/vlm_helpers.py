"""Tiny random vision-language models of real transformers architectures, with processors.

Each builder saves a model folder (config, weights, tokenizer, processor, chat template) that
`swiftlm sft --model <folder>` loads like a hub checkpoint. The tokenizer is the tests' small
ChatML BPE plus the architecture's image tokens.

Qwen2-VL: transformers 5 builds `Qwen2VLProcessor` only with its video processor, which
imports torchvision; torchvision has no build for this torch (2.13 CPU) on the registry, so
`AutoProcessor` cannot load a Qwen2-VL folder here. `qwen2_vl_processor` builds the same
processor class with the video half absent (image inputs are unaffected), and
`patched_qwen2_vl_loading` makes swiftlm's `load_processor` return it for such folders.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import numpy as np

from conftest import build_tokenizer

CHATML_WITH_IMAGES = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}IMAGE"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
ARCHITECTURES = ("qwen2_vl", "llava", "idefics3")


def _tokenizer(out: Path, extra: list[str], image_placeholder: str):
    tokenizer = build_tokenizer(out, None)
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.chat_template = CHATML_WITH_IMAGES.replace("IMAGE", image_placeholder)
    return tokenizer


def qwen2_vl_processor(folder: Path):
    """Qwen2VLProcessor of a saved tiny folder, without its (torchvision) video processor."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "image_processor.json").read_text())
    image_processor = Qwen2VLImageProcessor(**config)
    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, argument):
        return (
            None
            if name == "video_processor" and argument is None
            else original(self, name, argument)
        )

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check):
        processor = Qwen2VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=tokenizer.chat_template,
        )

    def save_pretrained(target, **_):  # ProcessorMixin's would save the absent video half
        tokenizer.save_pretrained(target)
        (Path(target) / "image_processor.json").write_text(json.dumps(config))

    processor.save_pretrained = save_pretrained
    return processor


@contextlib.contextmanager
def patched_qwen2_vl_loading():
    """swiftlm's load_processor builds Qwen2-VL processors with qwen2_vl_processor."""
    from swiftlm.models import vision

    original = vision.load_processor

    def load(path: str):
        folder = Path(path)
        if (folder / "image_processor.json").is_file():
            processor = qwen2_vl_processor(folder)
            processor.tokenizer.pad_token = processor.tokenizer.pad_token or "<|endoftext|>"
            return processor
        return original(path)

    with (
        mock.patch.object(vision, "load_processor", load),
        mock.patch("swiftlm.train.prepare.load_processor", load),
    ):
        yield


def build_qwen2_vl(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    image_tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer = _tokenizer(out, image_tokens, QWEN2_VL_IMAGE)
    tokenizer.save_pretrained(out)
    # 4 to 16 merged patches per image (28x28 pixels each).
    (out / "image_processor.json").write_text(
        json.dumps({"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16})
    )
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            **TEXT,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_chans=3,
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)
    return out


def build_llava(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer(out, ["<image>"], "<image>")
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=tokenizer.chat_template,
        num_additional_image_tokens=1,
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            projection_dim=32,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
            **TEXT,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def build_idefics3(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tokenizer = _tokenizer(out, specials + grid, "<image>")
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=4,
        chat_template=tokenizer.chat_template,
    )
    config = Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=7,
        ),
        text_config=dict(
            vocab_size=len(tokenizer),
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
            **TEXT,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).save_pretrained(out)
    processor.save_pretrained(out)
    return out


BUILDERS = {"qwen2_vl": build_qwen2_vl, "llava": build_llava, "idefics3": build_idefics3}


def write_picture(path: Path, rgb: tuple[int, int, int], size=(40, 32), seed: int = 0) -> Path:
    """A small PNG of one colour with a little noise (decodes to distinct pixel values)."""
    from PIL import Image

    noise = np.random.RandomState(seed).randint(0, 20, (size[1], size[0], 3))
    pixels = np.clip(np.array(rgb)[None, None, :] + noise, 0, 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return path


COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


def colour_rows(folder: Path, count: int = 8) -> list[dict]:
    """Rows asking the colour of a picture: `<image>` tags with relative `images` paths,
    plus one OpenAI-style image part and one text-only row."""
    rows = []
    names = list(COLOURS)
    for index in range(count):
        name = names[index % 3]
        size = (36 + 4 * index, 28 + 2 * index)
        write_picture(folder / f"picture{index}.png", COLOURS[name], size, seed=index)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>What colour is this?"},
                    {"role": "assistant", "content": f"It is {name}."},
                ],
                "images": [f"picture{index}.png"],
            }
        )
    part = {"type": "image_url", "image_url": {"url": str(folder / "picture1.png")}}
    rows.append(
        {
            "messages": [
                {"role": "user", "content": [part, {"type": "text", "text": "And this one?"}]},
                {"role": "assistant", "content": "Green."},
            ]
        }
    )
    rows.append(
        {
            "messages": [
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "Hello."},
            ]
        }
    )
    return rows
