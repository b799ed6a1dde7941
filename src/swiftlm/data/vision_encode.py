"""Encode conversations with images through the model's own processor.

For each sample: the conversation is rendered with the processor's chat template (an image
part becomes the model's image placeholder) and its loss spans found as for text
(data.encode); the rendered text is tokenized once with offsets, giving the labels of the
unexpanded text. The processor then decodes nothing itself: swiftlm decodes the sample's
images (data.images.load_image) and the processor expands each placeholder into exactly the
image tokens the model expects and computes the pixel features. The labels are carried over
to the expanded ids by aligning the two id sequences (the expansion only inserts image
tokens), and every image token is masked: images never carry loss.

Truncation never cuts an image: a sample longer than --max_length is cut (by
--truncation_strategy right/left) only where the removed part holds no image token;
otherwise it is deleted and counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from difflib import SequenceMatcher

import numpy as np

from swiftlm.data.encode import (
    IGNORE_INDEX,
    TruncationReport,
    assistant_char_spans,
    has_label_tokens,
    span_labels,
)
from swiftlm.data.images import load_image
from swiftlm.data.parts import content_images
from swiftlm.data.vision_batch import TEXT_OUTPUTS, cut_token_features, pack_features
from swiftlm.errors import DataError
from swiftlm.models.templates import end_of_turn_token

IMAGE_CUT = "deleted (truncation would cut an image)"


@dataclass
class ImageThroughput:
    """Images the processor turned into features, and the seconds it took."""

    images: int = 0
    seconds: float = 0.0
    workers: int = 1  # processes (--dataset_num_proc)

    def summary(self, processor) -> str:
        rate = self.images / self.seconds if self.seconds else 0.0
        processes = f" in {self.workers} processes" if self.workers > 1 else ""
        return (
            f"image preprocessing: {self.images} images in {self.seconds:.2f} s "
            f"({rate:.1f} images/s) with {type(processor).__name__}{processes}"
        )

    def cached_summary(self) -> str:
        """What a run that reads the features back from the tokenized-data cache says."""
        return (
            f"image preprocessing skipped: features of {self.images} images loaded from the "
            "tokenized-data cache"
        )


def encode_vision_chat(
    processor,
    messages: list[dict],
    scope: str,
    image_ids: set[int],
    throughput: ImageThroughput | None = None,
    tools: list | None = None,
    max_pixels: int = 0,
) -> dict:
    """{"input_ids", "labels", "vision"} of one conversation (vision: packed features)."""
    tokenizer = processor.tokenizer
    text, spans = assistant_char_spans(
        tokenizer, messages, scope, end_of_turn_token(tokenizer), tools, images=True
    )
    plain = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    plain_ids = list(plain["input_ids"])
    plain_labels = span_labels(plain_ids, plain["offset_mapping"], spans)
    references = [ref for m in messages for ref in content_images(m["content"])]
    started = time.perf_counter()
    images = [load_image(ref, max_pixels) for ref in references]
    outputs = processor(text=[text], images=images or None, return_tensors="np")
    if throughput is not None and images:
        throughput.images += len(images)
        throughput.seconds += time.perf_counter() - started
    ids = [int(i) for i in outputs["input_ids"][0]]
    labels = expand_labels(plain_ids, plain_labels, ids, image_ids)
    features = {k: np.asarray(v) for k, v in outputs.items() if k not in TEXT_OUTPUTS}
    return {"input_ids": ids, "labels": labels, "features": features}


def expand_labels(
    plain_ids: list[int], plain_labels: list[int], ids: list[int], image_ids: set[int]
) -> list[int]:
    """The labels of `plain_ids` carried over to the processor's `ids`.

    The processor only inserts image tokens, so every token of the plain text is found again,
    in order; inserted tokens and image tokens get IGNORE_INDEX. A labelled token that is not
    found means the processor changed the text: an error, not a silent mis-mask."""
    labels = [IGNORE_INDEX] * len(ids)
    matched = 0
    matcher = SequenceMatcher(None, plain_ids, ids, autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            labels[block.b + k] = plain_labels[block.a + k]
        matched += sum(1 for k in range(block.size) if plain_labels[block.a + k] != IGNORE_INDEX)
    wanted = sum(1 for label in plain_labels if label != IGNORE_INDEX)
    if matched != wanted:
        raise DataError(
            f"the processor changed {wanted - matched} trained token(s) of the text while "
            "expanding its images, so the labels cannot be placed; report this model's processor"
        )
    return [
        IGNORE_INDEX if token in image_ids else label
        for token, label in zip(ids, labels, strict=True)
    ]


def truncate_vision(
    sample: dict, max_length: int, strategy: str, report: TruncationReport, image_ids: set[int]
) -> dict | None:
    """--truncation_strategy for a sample with images; None means it is dropped (counted)."""
    ids, labels = sample["input_ids"], sample["labels"]
    cut = len(ids) > max_length
    if cut and strategy == "delete":
        report.counts["deleted"] += 1
        return None
    keep = slice(None)
    if cut:
        keep = slice(-max_length, None) if strategy == "left" else slice(0, max_length)
        removed = ids[: len(ids) - max_length] if strategy == "left" else ids[max_length:]
        if any(token in image_ids for token in removed):
            report.counts[IMAGE_CUT] += 1
            return None
        ids, labels = ids[keep], labels[keep]
    if not has_label_tokens(labels):
        report.counts["dropped (no label tokens left)" if cut else "dropped (no label tokens)"] += 1
        return None
    if cut:
        report.counts["truncated"] += 1
    features = cut_token_features(sample["features"], keep)
    return {"input_ids": ids, "labels": labels, "vision": pack_features(features)}


def encode_vision_samples(
    processor,
    samples: list[dict],
    max_length: int,
    strategy: str,
    scope: str,
    image_ids: set[int],
    max_pixels: int = 0,
    workers: int = 1,
) -> tuple[list[dict], TruncationReport, ImageThroughput]:
    """Encode conversations with images; like data.encode.encode_chat_samples otherwise.

    `workers` > 1 (--dataset_num_proc): contiguous chunks of the samples are encoded in that
    many fresh (spawned) processes, results kept in order. The throughput reported is images
    over the wall time of the whole encoding (process start included), in either case."""
    options = (max_length, strategy, scope, image_ids, max_pixels)
    started = time.perf_counter()
    if workers > 1 and len(samples) >= 2 * workers:
        encoded, report, throughput = _encode_in_workers(processor, samples, options, workers)
    else:
        encoded, report, throughput = _encode_chunk(processor, samples, *options)
    throughput.seconds = time.perf_counter() - started  # the whole encoding, as waited for
    if not encoded:
        raise DataError(
            f"no sample is left to train on with --max_length {max_length} and "
            f"--truncation_strategy {strategy} (of {len(samples)} samples: {report}); raise "
            "--max_length (a sample's image tokens count too), or lower --max_pixels"
        )
    return encoded, report, throughput


def _encode_chunk(processor, samples, max_length, strategy, scope, image_ids, max_pixels):
    """(encoded samples, truncation report, throughput) of some samples, in order."""
    report = TruncationReport(strategy, max_length)
    throughput = ImageThroughput()
    encoded = []
    for sample in samples:
        try:
            item = encode_vision_chat(
                processor,
                sample["messages"],
                scope,
                image_ids,
                throughput,
                sample.get("tools"),
                max_pixels,
            )
        except DataError as exc:
            raise DataError(f"{sample.get('source', 'sample')}: {exc}") from None
        except (OSError, ValueError) as exc:  # an image PIL could not decode, processor errors
            raise DataError(
                f"{sample.get('source', 'sample')}: its images could not be processed ({exc}); "
                "fix or remove the row"
            ) from None
        item = truncate_vision(item, max_length, strategy, report, image_ids)
        if item is not None:
            encoded.append(item)
    return encoded, report, throughput


# The processor of a worker process (set once per worker by _start_worker).
_WORKER_PROCESSOR = None


def _start_worker(processor) -> None:
    import torch

    global _WORKER_PROCESSOR
    _WORKER_PROCESSOR = processor
    torch.set_num_threads(1)  # the workers share the cores


def _encode_in_worker(samples: list[dict], options: tuple):
    return _encode_chunk(_WORKER_PROCESSOR, samples, *options)


def _encode_in_workers(processor, samples: list[dict], options: tuple, workers: int):
    """_encode_chunk over chunks in `workers` spawned processes (fork could copy locks held
    by torch's or the tokenizer's threads and hang), merged in order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    size = -(-len(samples) // (workers * 4))  # 4 chunks per worker even out slow images
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, context, _start_worker, (processor,)) as pool:
        results = list(pool.map(_encode_in_worker, chunks, [options] * len(chunks)))
    report = TruncationReport(options[1], options[0])
    throughput = ImageThroughput(workers=workers)
    encoded = []
    for chunk_encoded, chunk_report, chunk_throughput in results:
        encoded += chunk_encoded
        report.counts.update(chunk_report.counts)
        throughput.images += chunk_throughput.images
    return encoded, report, throughput
