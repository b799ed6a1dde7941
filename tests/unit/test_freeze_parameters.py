"""--freeze_parameters: name prefixes kept frozen in a full fine-tuning run (ms-swift's flag)."""

import pytest

from conftest import make_tiny_llama
from swiftlm.config.commands import TrainConfig
from swiftlm.config.rules import failures
from swiftlm.errors import ConfigError
from swiftlm.tuners.config import TunerArguments
from swiftlm.tuners.setup import apply_tuner


def trained(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def test_prefixes_freeze_whole_dotted_parts_only():
    model = make_tiny_llama(64)
    names = {name for name, _ in model.named_parameters()}
    prefixes = ["model.embed_tokens", "model.layers.1.self_attn"]
    apply_tuner(model, TunerArguments(train_type="full", freeze_parameters=prefixes))
    frozen = names - trained(model)
    assert frozen == {"model.embed_tokens.weight"} | {
        n for n in names if n.startswith("model.layers.1.self_attn.")
    }
    assert "model.layers.1.mlp.up_proj.weight" in trained(model)
    assert "lm_head.weight" in trained(model)  # untied here: only the named prefixes freeze


@pytest.mark.bad_input(
    input="--freeze_parameters model.embed (a prefix that is no whole name part)",
    outcome="ConfigError naming the prefix and what names look like; exit 2",
)
def test_a_prefix_that_matches_nothing_is_an_error():
    model = make_tiny_llama(64)
    args = TunerArguments(train_type="full", freeze_parameters=["model.embed"])
    with pytest.raises(ConfigError, match=r"--freeze_parameters model\.embed: no parameter"):
        apply_tuner(model, args)


@pytest.mark.bad_input(
    input="--freeze_parameters model lm_head (everything)",
    outcome="ConfigError: nothing would train; exit 2",
)
def test_freezing_everything_is_an_error():
    model = make_tiny_llama(64)
    args = TunerArguments(train_type="full", freeze_parameters=["model", "lm_head"])
    with pytest.raises(ConfigError, match="nothing would train"):
        apply_tuner(model, args)


@pytest.mark.bad_input(
    input="--freeze_parameters with --train_type lora",
    outcome="ConfigError: the flag is for full fine-tuning; exit 2",
)
def test_freeze_parameters_need_full_fine_tuning():
    config = TrainConfig(tuner=TunerArguments(freeze_parameters=["model.embed_tokens"]))
    broken = dict(failures(config))
    assert "--train_type lora" in broken["freeze_parameters_need_full"]
    config.tuner.train_type = "full"
    assert "freeze_parameters_need_full" not in dict(failures(config))
