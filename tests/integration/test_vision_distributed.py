"""SFT of a tiny vision-language model on 2 gloo ranks (DDP and FSDP2) equals one process with
the same global batch (per-device batch x ranks x gradient accumulation), in float32.

The data mixes rows with a picture and text-only rows, so that (with the run's seeded order)
a rank's micro-batch sometimes has no image while the other rank's has one, and a whole step
sometimes has no image at all. The vision encoder and aligner are trained, so a rank that
skips them gives them no gradient: DDP needs unused-parameter detection for that, and FSDP2
keeps them in its root unit, reduce-scatters zeros for them and then gives parameters no rank
used no gradient, as one process does (without that, AdamW moves them by momentum and the
runs differ by ~1e-3).

Each 2-rank launch costs ~10-20 s (two torch imports and model loads on 2 shared cores).
"""

import json

import pytest

from conftest import logged, max_weight_difference, stopped_at, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, forward_terms
from vlm_helpers import build_idefics3, build_llava, colour_rows

FULL, ADAPTER = "model.safetensors", "adapter_model.safetensors"
STEPS = dict(max_steps=4, gradient_accumulation_steps=2, learning_rate="1e-3", save_steps=2)
TRAIN_ALL = dict(freeze_vit="false", freeze_aligner="false")
WORDS = ("one", "two", "three", "four", "five", "six")


def rows_with_and_without_images(folder):
    """9 rows with a picture, 7 text-only ones (16 samples: 4 steps of 4)."""
    text = [
        {
            "messages": [
                {"role": "user", "content": f"Say {word}."},
                {"role": "assistant", "content": f"{word.capitalize()}."},
            ]
        }
        for word in WORDS
    ]
    return write_jsonl(folder / "rows.jsonl", colour_rows(folder, 8) + text)


@pytest.fixture(scope="module")
def llava_runs(tmp_path_factory):
    """The tiny LLaVA, its data, and the one-process reference run (2 samples x 2 micro-batches
    per step), full fine-tuning of all three parts."""
    root = tmp_path_factory.mktemp("vlm-dist")
    model = build_llava(root / "llava")
    (root / "data").mkdir()
    data = rows_with_and_without_images(root / "data")
    flags = dict(train_type="full", **TRAIN_ALL, **STEPS)
    single = root / "single"
    assert main(tiny_sft(model, data, single, per_device_train_batch_size=2, **flags)) == 0
    return model, data, flags, single, root


def moved(file_a, file_b, prefix: str) -> float:
    """The largest change between two weight files among the tensors under `prefix`."""
    from safetensors.torch import load_file

    a, b = load_file(file_a), load_file(file_b)
    names = [k for k in a if k.removeprefix("model.").startswith(prefix)]
    assert names, prefix
    return max((a[k] - b[k]).abs().max().item() for k in names)


def two_ranks(model, data, out, port, **flags):
    argv = tiny_sft(
        model,
        data,
        out,
        per_device_train_batch_size=1,
        nproc_per_node=2,
        master_port=port,
        dist_timeout=120,  # a rank stuck in a collective fails the test quickly
        **flags,
    )
    assert main(argv) == 0


def assert_same_run(run, reference, weights):
    """Equal up to rounding (tests/tolerance.py): the losses behind the text model's chain over
    a row of at most every training token (data_health.json), twice over for the image tower
    before it (2 layers, at most 64 wide: a shorter chain), and the two ranks' all-reduce; the
    weights up to Adam's bound. Returns the largest weight difference (printed)."""
    assert len(logged(run)) == 4
    tokens = json.loads((reference / "data_health.json").read_text())["train"]["tokens"]
    terms = 2 * forward_terms(tokens) + 2
    assert_close(logged(run), logged(reference), terms=terms, what="losses")
    a, b = run / "final" / weights, reference / "final" / weights
    assert_trained_weights_close(a, b, learning_rate=1e-3, steps=4)  # STEPS
    return max_weight_difference(a, b)


@pytest.mark.numerics
def test_ddp_matches_one_process_when_a_rank_has_no_image(llava_runs, capfd):
    model, data, flags, single, root = llava_runs
    ddp = root / "ddp"
    two_ranks(model, data, ddp, 29971, **flags)
    print(f"DDP max weight difference: {assert_same_run(ddp, single, FULL):.2e}")
    assert all(n > 0 for n in logged(ddp, "comm_bytes_per_rank"))  # DDP's all-reduce ran
    # The vision parts changed (they trained), and the final folder is a loadable VLM folder
    # with its processor (checkpoints pass the processor where a text LM's tokenizer goes).
    final = ddp / "final"
    assert moved(final / FULL, model / FULL, "vision_tower.") > 1e-4
    assert moved(final / FULL, model / FULL, "multi_modal_projector.") > 1e-4
    from transformers import AutoModelForImageTextToText, AutoProcessor

    assert type(AutoProcessor.from_pretrained(final)).__name__ == "LlavaProcessor"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    AutoModelForImageTextToText.from_pretrained(final)


@pytest.mark.numerics
def test_fsdp2_matches_one_process_and_its_checkpoint_resumes_on_one(llava_runs):
    model, data, flags, single, root = llava_runs
    sharded = root / "fsdp2"
    two_ranks(model, data, sharded, 29972, strategy="fsdp2", **flags)
    print(f"FSDP2 max weight difference: {assert_same_run(sharded, single, FULL):.2e}")
    step = sharded / "checkpoints" / "step-2"
    assert (step / "dcp" / ".metadata").is_file() and (step / "processor_config.json").is_file()
    at_step_2 = single / "checkpoints" / "step-2" / FULL
    assert_trained_weights_close(step / FULL, at_step_2, learning_rate=1e-3, steps=2)

    # Saved sharded by 2 ranks (vision parts in the root unit), resumed by one process.
    resumed = stopped_at(sharded, 2, root / "fsdp2-resumed")
    argv = tiny_sft(model, data, resumed, per_device_train_batch_size=2, **flags)
    assert main([*argv, "--resume_from_checkpoint", "auto"]) == 0
    assert_same_run(resumed, single, FULL)


@pytest.mark.numerics
@pytest.mark.parametrize("strategy, port", [("ddp", 29973), ("fsdp2", 29974)])
def test_idefics3_lora_with_trained_vision_parts_matches_one_process(strategy, port, tmp_path):
    """LoRA on the vision encoder and the language model, the aligner trained in full (peft
    modules_to_save), images padded per sample (Idefics3's [sample, image, ...] layout).

    Under FSDP2 the first language-model block's input needs a gradient only on a rank with
    images (LoRA leaves the embeddings frozen): without fsdp2.same_reduction_order the ranks
    reduce-scatter in different orders and gloo fails on mismatched sizes.
    At --learning_rate 1e-2 the vision LoRA A matrices (whose first gradients are ~0 while B is
    0, which AdamW scales up) differ by ~5e-6..5e-5 from one process, under DDP and FSDP2
    alike: the float32 noise of micro-batches of 1 vs 2 padded samples, not the strategy."""
    model = build_idefics3(tmp_path / "idefics3")
    (tmp_path / "data").mkdir()
    data = rows_with_and_without_images(tmp_path / "data")
    flags = dict(**TRAIN_ALL, **STEPS, lora_dropout=0)
    flags.update(save_steps=100)
    single, parallel = tmp_path / "single", tmp_path / strategy
    assert main(tiny_sft(model, data, single, per_device_train_batch_size=2, **flags)) == 0
    two_ranks(model, data, parallel, port, strategy=strategy, **flags)
    difference = assert_same_run(parallel, single, ADAPTER)
    print(f"Idefics3 LoRA {strategy} max adapter difference: {difference:.2e}")
    from safetensors import safe_open

    with safe_open(parallel / "final" / ADAPTER, "pt") as f:
        keys = list(f.keys())
    assert any(".vision_model." in k and "lora_A" in k for k in keys)
    assert any(".connector." in k and "lora_" not in k for k in keys)


@pytest.mark.numerics
def test_default_lora_with_a_frozen_vision_tower_matches_under_fsdp2(llava_runs):
    """The default VLM LoRA: adapters in the language model only, the vision tower and the
    aligner frozen. Still, a rank runs the frozen tower only when it has images, so the tower
    must not be FSDP units of its own (their all-gathers would pair with the other rank's
    language-model ones)."""
    model, data, _, _, root = llava_runs
    flags = dict(**STEPS, lora_dropout=0)
    flags.update(save_steps=100)
    single, sharded = root / "lora-single", root / "lora-fsdp2"
    assert main(tiny_sft(model, data, single, per_device_train_batch_size=2, **flags)) == 0
    two_ranks(model, data, sharded, 29975, strategy="fsdp2", **flags)
    difference = assert_same_run(sharded, single, ADAPTER)
    print(f"LLaVA default LoRA fsdp2 max adapter difference: {difference:.2e}")


@pytest.mark.bad_input(
    input="`--deepspeed zero3` with a vision-language model on several ranks (ZeRO-1/2: when "
    "the vision encoder or aligner trains)",
    outcome="Error before the engine starts: a rank without images would skip the vision "
    "encoder and the ranks would wait for each other forever; use --strategy fsdp2 or ddp",
)
def test_deepspeed_refuses_a_vision_language_model_it_would_hang_on(llava_runs, capfd):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra")
    model, data, _, _, root = llava_runs
    argv = tiny_sft(
        model,
        data,
        root / "zero3",
        per_device_train_batch_size=1,
        nproc_per_node=2,
        master_port=29976,
        dist_timeout=60,
        deepspeed="zero3",
        **STEPS,
    )
    assert main(argv) == 2
    printed = capfd.readouterr()
    assert "--deepspeed zero3 with a vision-language model (llava) on 2 ranks" in printed.err
    assert "use --strategy fsdp2 or ddp" in printed.err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_without_state_for_an_unused_parameter_loads(tmp_path):
    """A layer that got no gradient before the save (a vision encoder on steps without images)
    has no optimizer state in dcp/; loading leaves it without state instead of failing."""
    import torch

    from swiftlm.checkpoint.sharded import load_sharded_state, save_sharded_state

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, optimizer = build()
    model[0](torch.ones(2, 4)).sum().backward()  # the second layer never runs
    optimizer.step()
    save_sharded_state(tmp_path, model, optimizer)  # one process, no process group
    loaded, fresh = build()
    load_sharded_state(tmp_path, loaded, fresh)
    assert torch.equal(loaded[0].weight, model[0].weight)
    assert torch.equal(
        fresh.state[loaded[0].weight]["exp_avg"], optimizer.state[model[0].weight]["exp_avg"]
    )
    assert not fresh.state.get(loaded[1].weight)
