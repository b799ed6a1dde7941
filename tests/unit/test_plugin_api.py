"""The public plugin API: its surface is what docs/plugins.md documents, versions are checked,
each register_* function adds to its layer's registry (and that layer uses it), names are
not taken twice, and plugin code that fails names its plugin."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import swiftlm.plugins as plugins
from plugin_isolation import isolated_plugins  # noqa: F401 (a fixture)
from swiftlm.data.formats import chat_sample, text_sample
from swiftlm.errors import ConfigError
from swiftlm.plugins import PluginError

pytestmark = pytest.mark.usefixtures("isolated_plugins")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def test_the_public_names_are_the_documented_ones():
    documented = re.findall(r"^### `(\w+)", DOCS.read_text(), flags=re.MULTILINE)
    assert sorted(documented) == sorted(plugins.__all__)
    assert all(hasattr(plugins, name) for name in plugins.__all__)
    assert f"version {plugins.API_VERSION}" in DOCS.read_text().splitlines()[0]


@pytest.mark.parametrize("needed", ["1.0", "1"])
def test_the_api_version_a_plugin_needs_is_checked(needed):
    plugins.require_api("1.0")
    for unsupported in ("1.1", "2.0", "0.9"):
        with pytest.raises(PluginError, match=f"needs the swiftlm plugin API {unsupported}, but"):
            plugins.require_api(unsupported)
    if needed == "1":
        with pytest.raises(PluginError, match="not of the form MAJOR.MINOR"):
            plugins.require_api(needed)


def test_a_taken_name_is_refused_naming_both_owners_unless_replaced():
    plugins.register_loss("mine", lambda logits, targets: logits.sum())
    with pytest.raises(PluginError) as info:
        plugins.register_loss("mine", lambda logits, targets: logits.sum())
    here = f"module {__name__}"
    assert str(info.value) == (
        f"{here}: cannot register loss 'mine': the name is already registered by {here}; "
        "choose another name, or pass replace=True to replace it"
    )
    plugins.register_loss("mine", lambda logits, targets: logits.sum() * 0, replace=True)
    with pytest.raises(PluginError, match="already registered by swiftlm \\(built in\\)"):
        plugins.register_tool_parser("hermes", lambda text: (text, []))


def test_a_format_converts_detected_rows_and_named_rows():
    plugins.register_dataset_format(
        "qa",
        lambda row: {"messages": [{"role": "user", "content": row["q"]},
                                  {"role": "assistant", "content": row["a"]}]},
        detect=lambda row: "q" in row,
    )  # fmt: skip
    plugins.register_dataset_format("lines", lambda row: {"text": "\n".join(row["lines"])})
    assert chat_sample({"q": "hi", "a": "yo"})["messages"][1] == {
        "role": "assistant",
        "content": "yo",
    }
    # A row in a built-in format is left alone; an undetected format only when named.
    assert chat_sample({"query": "a", "response": "b", "q": "x"})["messages"][0]["content"] == "a"
    assert text_sample({"lines": ["a", "b"]}, "lines") == {"text": "a\nb"}
    with pytest.raises(plugins.RowError, match="no recognizable format"):
        text_sample({"lines": ["a", "b"]})
    with pytest.raises(ConfigError, match="--dataset_format nope: not a registered dataset format"):
        chat_sample({"q": "hi", "a": "yo"}, row_format="nope")


def test_a_failing_converter_names_its_plugin_and_line():
    def convert(row):
        return {"messages": row["missing"]}

    plugins.register_dataset_format("broken", convert, detect=lambda row: True)
    with pytest.raises(PluginError) as info:
        chat_sample({"x": 1})
    line = convert.__code__.co_firstlineno + 1
    assert f"dataset format 'broken' of module {__name__} failed at {__file__}:{line}" in str(
        info.value
    )
    assert "KeyError: 'missing'" in str(info.value)


def test_a_registered_loss_gets_shifted_targets_and_its_sum_is_checked():
    from swiftlm.losses.causal_lm import registered_loss_sum

    seen = {}

    def count_targets(logits, targets):
        seen["targets"] = targets
        return (targets != -100).sum().float()

    plugins.register_loss("count", count_targets)
    labels = torch.tensor([[-100, 5, 6, -100]])
    assert registered_loss_sum("count", torch.zeros(1, 4, 8), labels) == 2
    assert seen["targets"].tolist() == [[5, 6, -100, -100]]
    plugins.register_loss("vector", lambda logits, targets: logits.sum(-1))
    with pytest.raises(TypeError, match="must return a 0-d tensor"):
        registered_loss_sum("vector", torch.zeros(1, 4, 8), labels)


def test_callbacks_run_on_rank_0_unless_they_ask_for_every_rank(tmp_path):
    from swiftlm.train.callbacks import TrainCallbacks

    calls = []

    class Everywhere:
        def on_train_start(self, run_dir, step, num_steps):
            calls.append(("everywhere", step, num_steps))

    class MainOnly:
        def on_train_start(self, **kwargs):
            calls.append(("main", kwargs["step"], kwargs["num_steps"]))

    plugins.register_callback("main_only", MainOnly)
    plugins.register_callback("everywhere", Everywhere(), all_ranks=True)
    for is_main in (True, False):
        job = SimpleNamespace(strategy=SimpleNamespace(ctx=SimpleNamespace(is_main=is_main)),
                              run_dir=tmp_path, checkpoint_tiers=None)  # fmt: skip
        TrainCallbacks(job, SimpleNamespace(step=3), 10)
    assert calls == [("main", 3, 10), ("everywhere", 3, 10), ("everywhere", 3, 10)]


def test_bad_callbacks_are_refused_and_a_raising_one_names_its_plugin(tmp_path):
    from swiftlm.train.callbacks import TrainCallbacks

    with pytest.raises(PluginError, match="has none of on_train_start, on_step_end"):
        plugins.register_callback("nothing", object())
    with pytest.raises(PluginError, match="on_save has the wrong signature"):
        plugins.register_callback("old", SimpleNamespace(on_save=lambda checkpoint: None))

    class Raising:
        def on_train_start(self, **kwargs):
            raise OSError("disk full")

    plugins.register_callback("raising", Raising)
    job = SimpleNamespace(strategy=SimpleNamespace(ctx=SimpleNamespace(is_main=True)),
                          run_dir=tmp_path, checkpoint_tiers=None)  # fmt: skip
    with pytest.raises(PluginError, match="callback 'raising' \\(on_train_start\\) of module"):
        TrainCallbacks(job, SimpleNamespace(step=0), 1)


def test_templates_parsers_tasks_and_loaders_reach_their_registries(tiny_model_dir, tmp_path):
    from swiftlm.evaluation.task_file import BUILTIN_TASKS
    from swiftlm.methods.registry import METHODS
    from swiftlm.methods.sft import SFT
    from swiftlm.models.loader import load_model, load_tokenizer
    from swiftlm.serve.tools import ParsedCall, tool_message

    plugins.register_chat_template(
        "llama", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    )
    with pytest.raises(PluginError, match="must be a Jinja template string"):
        plugins.register_chat_template("qwen2", 42)

    plugins.register_tool_parser("whole", lambda text: ("", [ParsedCall(text, {"x": 1})]))
    message, has_calls = tool_message("lookup", parser="whole")
    assert has_calls and message["tool_calls"][0]["function"]["name"] == "lookup"

    plugins.register_eval_task("acme/task", lambda placeholders: ("task", placeholders))
    assert BUILTIN_TASKS["acme/task"]({"{{NAME}}": "x"}) == ("task", {"{{NAME}}": "x"})

    class TinySFT(SFT):
        pass

    plugins.register_method("tiny_sft", TinySFT)
    assert METHODS["tiny_sft"] is TinySFT
    with pytest.raises(PluginError, match="must be a class"):
        plugins.register_method("not_a_class", object())

    def build(path, dtype, device, attn_impl, kind):
        return torch.nn.Linear(2, 2)

    plugins.register_model_loader("acme", build, prefix="acme:")
    model = load_model("acme:tiny", torch.float32, torch.device("cpu"))
    assert isinstance(model, torch.nn.Linear)
    with pytest.raises(PluginError, match="needs model_types or a prefix"):
        plugins.register_model_loader("nowhere", build)


def test_an_rlhf_method_reads_only_the_flags_it_declares():
    from swiftlm.config.commands import UNUSED_FLAGS, RLHFConfig
    from swiftlm.config.parse import parse_config
    from swiftlm.methods.preference.dpo import DPO

    class Weighted(DPO):
        pass

    def parse(*argv):
        return parse_config(RLHFConfig, list(argv), "swiftlm rlhf", "", UNUSED_FLAGS["rlhf"])

    plugins.register_method(
        "weighted", Weighted, rlhf=True, loss_types=("sigmoid", "ipo"), beta=0.3,
        reads=("ref_model",),
    )  # fmt: skip
    cfg = parse("--rlhf_type", "weighted", "--ref_model", "ref-folder")
    assert (cfg.rlhf.beta, cfg.rlhf.loss_type, cfg.rlhf.ref_model) == (0.3, "sigmoid", "ref-folder")
    with pytest.raises(ConfigError, match="--rpo_alpha is not used by --rlhf_type weighted "
                                          r"\(read by --rlhf_type dpo\)"):  # fmt: skip
        parse("--rlhf_type", "weighted", "--rpo_alpha", "0.5")
    with pytest.raises(ConfigError, match="--rlhf_type weighted accepts sigmoid, ipo"):
        parse("--rlhf_type", "weighted", "--loss_type", "hinge")
    with pytest.raises(PluginError, match="reads ref_modle, which no section of swiftlm rlhf has"):
        plugins.register_method("typo", Weighted, rlhf=True, reads=("ref_modle",))
