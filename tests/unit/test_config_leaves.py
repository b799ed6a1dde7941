"""The sections live beside their features as leaf modules (docs/architecture.md, "Config
beside its feature"): parsing stays free of torch, and each method's flag facts name real
flags and registered methods."""

import dataclasses
import subprocess
import sys

from swiftlm.config.commands import COMMAND_CONFIGS
from swiftlm.methods.config import RLHF_METHODS, RLHFArguments
from swiftlm.methods.rl.config import GKDArguments, GRPOArguments

PARSE_RLHF = """
import sys
from swiftlm.config.commands import UNUSED_FLAGS, RLHFConfig
from swiftlm.config.parse import parse_config
cfg = parse_config(RLHFConfig, ["--rlhf_type", "grpo", "--num_generations", "4"],
                   "swiftlm rlhf", "", UNUSED_FLAGS["rlhf"])
assert cfg.grpo.temperature == 1.0, cfg.grpo.temperature
print(sorted(m for m in ("torch", "peft", "datasets") if m in sys.modules))
"""


def test_parsing_a_command_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", PARSE_RLHF], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_section_lives_in_a_config_module_beside_its_feature():
    for command, config in COMMAND_CONFIGS.items():
        for f in dataclasses.fields(config):
            module = f.default_factory.__module__
            shared = module == "swiftlm.config.sections"  # OverwriteArguments
            assert shared or module.endswith(".config"), (command, f.name, module)


def test_each_rlhf_method_reads_real_flags_and_is_a_registered_method():
    from swiftlm.methods.registry import METHODS

    flags = {
        f.name for section in (RLHFArguments, GRPOArguments, GKDArguments)
        for f in dataclasses.fields(section)
    }  # fmt: skip
    for name, facts in RLHF_METHODS.items():
        assert name in METHODS, name
        assert facts.reads <= flags, (name, facts.reads - flags)
        assert set(facts.defaults) <= flags, (name, facts.defaults)
        assert (facts.beta is None) or facts.beta_check.ok(facts.beta), name
