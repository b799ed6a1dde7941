"""Checkpoints: optimizer/RNG state without pickle, exact restore, resume selection, pruning."""

import copy
import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from swiftlm.checkpoint import (
    checkpoint_dir,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from swiftlm.checkpoint.tensors import (
    capture_rng,
    optimizer_from_files,
    optimizer_to_files,
    restore_rng,
)
from swiftlm.distributed.config import DistArguments
from swiftlm.distributed.env import DistContext
from swiftlm.distributed.strategy import build_strategy
from swiftlm.errors import CheckpointError

SINGLE = build_strategy(DistArguments(), DistContext(), torch.device("cpu"))


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """These tests set the global RNGs; leave them as they were for other tests."""
    torch_state, py_state, np_state = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    yield
    torch.set_rng_state(torch_state)
    random.setstate(py_state)
    np.random.set_state(np_state)


def tiny_llama(seed: int = 0, layers: int = 1, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def adamw(model, lr=1e-2):
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def lm_step(model, optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (2, 8), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def linear_step(model, optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=generator)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def json_normalized(value):
    """What survives a JSON round trip (tuples become lists)."""
    return json.loads(json.dumps(value))


def assert_optimizer_states_equal(restored: dict, original: dict) -> None:
    assert sorted(restored["state"]) == sorted(original["state"])
    for index, param_state in original["state"].items():
        assert sorted(restored["state"][index]) == sorted(param_state)
        for key, value in param_state.items():
            other = restored["state"][index][key]
            if torch.is_tensor(value):
                assert other.dtype == value.dtype, (index, key)
                assert torch.equal(other, value), (index, key)
            else:
                assert other == value, (index, key)
    assert json_normalized(restored["param_groups"]) == json_normalized(original["param_groups"])


def rng_draws() -> tuple:
    return (
        torch.rand(4).tolist(),
        torch.randn(3).tolist(),
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(3).tolist(),
    )


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# ---- optimizer and RNG state ----------------------------------------------------------------


def test_optimizer_files_round_trip_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    optimizer = adamw(model)
    for seed in range(2):
        linear_step(model, optimizer, seed)

    tensors, meta = optimizer_to_files(optimizer)
    assert set(tensors) == {f"{i}.{k}" for i in (0, 1) for k in ("step", "exp_avg", "exp_avg_sq")}
    # Through the files a checkpoint uses: safetensors + JSON, no pickle.
    save_file(tensors, str(tmp_path / "opt.safetensors"))
    (tmp_path / "opt.json").write_text(json.dumps(meta))
    restored = optimizer_from_files(
        load_file(str(tmp_path / "opt.safetensors")),
        json.loads((tmp_path / "opt.json").read_text()),
    )
    assert_optimizer_states_equal(restored, optimizer.state_dict())

    twin = copy.deepcopy(model)
    twin_optimizer = adamw(twin, lr=123.0)  # hyperparameters must come from the files
    twin_optimizer.load_state_dict(restored)
    assert_optimizer_states_equal(twin_optimizer.state_dict(), optimizer.state_dict())
    assert twin_optimizer.param_groups[0]["lr"] == 1e-2
    assert twin_optimizer.state[twin.weight]["step"].item() == 2.0

    linear_step(model, optimizer, seed=7)
    linear_step(twin, twin_optimizer, seed=7)
    assert torch.equal(twin.weight, model.weight)
    assert torch.equal(twin.bias, model.bias)
    assert_optimizer_states_equal(twin_optimizer.state_dict(), optimizer.state_dict())


def test_optimizer_files_keep_non_tensor_state():
    meta = {"param_groups": [{"lr": 0.1, "params": [0]}], "scalars": {"0.step": 3}}
    tensors = {"0.momentum_buffer": torch.ones(2)}
    restored = optimizer_from_files(tensors, meta)
    assert restored["state"][0]["step"] == 3
    assert torch.equal(restored["state"][0]["momentum_buffer"], torch.ones(2))
    assert restored["param_groups"] == meta["param_groups"]


def test_rng_capture_and_restore_all_streams(tmp_path):
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    # Leave a cached Gaussian in python's and numpy's generators: it is state too.
    random.gauss(0, 1)
    np.random.randn(1)
    assert random.getstate()[2] is not None
    assert np.random.get_state()[3] == 1

    tensors, meta = capture_rng()
    save_file(tensors, str(tmp_path / "rng.safetensors"))
    meta = json.loads(json.dumps(meta))
    expected = rng_draws()
    rng_draws()  # move every stream further on

    restore_rng(load_file(str(tmp_path / "rng.safetensors")), meta)
    assert rng_draws() == expected


# ---- save / load ----------------------------------------------------------------------------

STATE = {
    "step": 2,
    "epoch": 1,
    "micro_batch": 3,
    "tokens_seen": 96,
    "train_seconds": 1.25,
    "last_loss": 3.5,
    "last_eval_loss": None,
    "skipped_steps": 0,
    "num_train_samples": 10,
    "scheduler": {"last_epoch": 2, "_step_count": 3, "base_lrs": [0.01, 0.01]},
    "grad_scaler": None,
}


def test_save_and_load_full_model_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(seed=0)
    optimizer = adamw(model)
    for seed in range(2):
        lm_step(model, optimizer, seed)
    folder = checkpoint_dir(tmp_path, 2)
    assert folder == tmp_path / "checkpoints" / "step-2"

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    save_checkpoint(folder, SINGLE, model, optimizer, STATE)
    expected_draws = rng_draws()
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    names = {p.name for p in folder.iterdir()}
    assert {"COMPLETE", "config.json", "model.safetensors", "optimizer.safetensors"} <= names
    assert {"optimizer.json", "rng.safetensors", "trainer_state.json"} <= names
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt"))
    assert (folder / "COMPLETE").read_text() == "step 2\n"

    other = tiny_llama(seed=1)
    other_optimizer = adamw(other, lr=5.0)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    state = load_checkpoint(folder, SINGLE, other, other_optimizer)

    assert state == {**STATE, "world_size": 1}
    assert_same_weights(other, model)
    assert_optimizer_states_equal(other_optimizer.state_dict(), optimizer.state_dict())
    assert rng_draws() == expected_draws

    # Exact resume: the next step is bit-identical.
    lm_step(model, optimizer, seed=9)
    lm_step(other, other_optimizer, seed=9)
    assert_same_weights(other, model)

    # The folder is a plain transformers model.
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert sorted(reloaded.state_dict()) == sorted(saved_weights)
    assert all(torch.equal(v, saved_weights[k]) for k, v in reloaded.state_dict().items())


def test_tied_embeddings_load_without_lm_head_in_file(tmp_path):
    model = tiny_llama(seed=0, tie=True)
    optimizer = adamw(model)
    lm_step(model, optimizer, 0)
    folder = checkpoint_dir(tmp_path, 1)
    save_checkpoint(folder, SINGLE, model, optimizer, {"step": 1})
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))

    other = tiny_llama(seed=1, tie=True)
    assert load_checkpoint(folder, SINGLE, other, adamw(other)) == {"step": 1, "world_size": 1}
    assert_same_weights(other, model)
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()


def test_checkpoint_from_a_different_model_is_rejected(tmp_path):
    model = tiny_llama(seed=0, layers=1)
    folder = checkpoint_dir(tmp_path, 1)
    save_checkpoint(folder, SINGLE, model, adamw(model), {"step": 1})
    bigger = tiny_llama(seed=0, layers=2)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, SINGLE, bigger, adamw(bigger))
    message = str(info.value)
    assert "missing" in message and "model.layers.1." in message
    assert "different model" in message


def test_incomplete_checkpoint_is_refused(tmp_path):
    model = tiny_llama(seed=0)
    folder = checkpoint_dir(tmp_path, 3)
    save_checkpoint(folder, SINGLE, model, adamw(model), {"step": 3})
    (folder / "COMPLETE").unlink()
    other = tiny_llama(seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, SINGLE, other, adamw(other))
    message = str(info.value)
    assert "incomplete" in message
    assert str(folder) in message
    assert "--resume_from_checkpoint auto" in message
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_save_overwrites_an_existing_folder(tmp_path):
    model = tiny_llama(seed=0)
    folder = checkpoint_dir(tmp_path, 4)
    folder.mkdir(parents=True)
    (folder / "stale.safetensors").write_bytes(b"junk from a crashed save")
    save_checkpoint(folder, SINGLE, model, adamw(model), {"step": 4})
    assert not (folder / "stale.safetensors").exists()
    other = tiny_llama(seed=1)
    load_checkpoint(folder, SINGLE, other, adamw(other))
    assert_same_weights(other, model)


def test_lora_checkpoint_restores_adapter_weights(tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        tiny_llama(seed=0),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    with torch.no_grad():  # lora_B starts at zero; make every adapter weight distinctive
        for p in lora.values():
            p.copy_(torch.randn_like(p))
    optimizer = adamw(model)
    lm_step(model, optimizer, 0)
    saved = {n: p.detach().clone() for n, p in lora.items()}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    folder = checkpoint_dir(tmp_path, 1)
    save_checkpoint(folder, SINGLE, model, optimizer, {"step": 1, "epoch": 0, "micro_batch": 1})
    assert (folder / "adapter_config.json").is_file()
    assert (folder / "adapter_model.safetensors").is_file()
    assert not (folder / "model.safetensors").exists()
    optimizer_state = copy.deepcopy(optimizer.state_dict())

    with torch.no_grad():
        for p in lora.values():
            p.add_(torch.randn_like(p))
    lm_step(model, optimizer, 1)  # also moves the optimizer state on
    assert not torch.equal(next(iter(lora.values())), next(iter(saved.values())))

    state = load_checkpoint(folder, SINGLE, model, optimizer)
    assert state == {"step": 1, "epoch": 0, "micro_batch": 1, "world_size": 1}
    for name, p in model.named_parameters():
        expected = saved[name] if p.requires_grad else frozen[name]
        assert torch.equal(p, expected), name
    assert_optimizer_states_equal(optimizer.state_dict(), optimizer_state)


# ---- resume selection and pruning -----------------------------------------------------------


def make_run(tmp_path, complete, incomplete):
    for step in complete + incomplete:
        folder = checkpoint_dir(tmp_path, step)
        folder.mkdir(parents=True)
        if step in complete:
            (folder / "COMPLETE").write_text(f"step {step}\n")
    (tmp_path / "checkpoints" / "step-latest").mkdir()  # not a step folder
    (tmp_path / "checkpoints" / "step-99").write_text("a file, not a folder")
    return tmp_path


def steps(folders):
    return [int(p.name[5:]) for p in folders]


def test_list_checkpoints_sorts_numerically(tmp_path):
    run = make_run(tmp_path, complete=[5, 9, 10], incomplete=[3, 12, 100])
    complete, incomplete = list_checkpoints(run)
    assert steps(complete) == [5, 9, 10]
    assert steps(incomplete) == [3, 12, 100]
    assert list_checkpoints(tmp_path / "no-such-run") == ([], [])


def test_find_resume_auto_picks_newest_complete_and_reports_skipped(tmp_path):
    run = make_run(tmp_path, complete=[5, 9, 10], incomplete=[3, 7, 12, 100])
    folder, skipped = find_resume_checkpoint(run, "auto")
    assert folder == checkpoint_dir(run, 10)
    assert steps(skipped) == [12, 100]


def test_find_resume_auto_without_complete_checkpoints(tmp_path):
    assert find_resume_checkpoint(tmp_path, "auto") == (None, [])
    run = make_run(tmp_path, complete=[], incomplete=[2, 4])
    folder, skipped = find_resume_checkpoint(run, "auto")
    assert folder is None
    assert steps(skipped) == [2, 4]


def test_find_resume_explicit_folder(tmp_path):
    run = make_run(tmp_path, complete=[5], incomplete=[])
    assert find_resume_checkpoint(run, str(checkpoint_dir(run, 5))) == (checkpoint_dir(run, 5), [])
    with pytest.raises(CheckpointError, match="no such folder"):
        find_resume_checkpoint(run, str(tmp_path / "missing"))


def test_prune_keeps_newest_complete_and_removes_old_leftovers(tmp_path):
    run = make_run(tmp_path, complete=[5, 9, 10, 20], incomplete=[3, 12, 25])
    removed = prune_checkpoints(run, keep=2)
    assert steps(removed) == [5, 9, 3, 12]
    assert all(not p.exists() for p in removed)
    complete, incomplete = list_checkpoints(run)
    assert steps(complete) == [10, 20]
    assert steps(incomplete) == [25]  # newer than the newest complete: maybe being written


@pytest.mark.parametrize("keep", [0, 1])
def test_prune_never_removes_the_newest_complete(tmp_path, keep):
    run = make_run(tmp_path, complete=[5, 9, 10], incomplete=[11])
    prune_checkpoints(run, keep=keep)
    complete, incomplete = list_checkpoints(run)
    assert steps(complete) == [10]
    assert steps(incomplete) == [11]


def test_prune_without_limit_only_removes_leftovers(tmp_path):
    run = make_run(tmp_path, complete=[5, 9], incomplete=[2, 7, 10])
    assert steps(prune_checkpoints(run, keep=None)) == [2, 7]
    assert [steps(x) for x in list_checkpoints(run)] == [[5, 9], [10]]
    assert prune_checkpoints(run, keep=5) == []


def test_prune_without_complete_checkpoints_removes_nothing(tmp_path):
    run = make_run(tmp_path, complete=[], incomplete=[2, 4])
    assert prune_checkpoints(run, keep=1) == []
    assert steps(list_checkpoints(run)[1]) == [2, 4]
