"""`swiftlm export --to_onnx`: an ONNX folder whose logits equal the torch model's.

The exporter checks itself on the chat prompts; these tests check the file again on their own,
with onnxruntime directly, on other inputs and other batch/sequence/cache sizes (left padding
included), so a graph that only works for the shapes it was traced or checked with fails here.
"""

import contextlib
import io
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import CHAT_ROWS

from swiftlm.cli.main import main
from tolerance import assert_close, forward_terms

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from swiftlm.export import onnx as onnx_export  # noqa: E402
from swiftlm.export import onnx_check, onnx_graph  # noqa: E402

CHECK_LINE = "checked with onnxruntime on 5 chat prompts"


def _export(argv: list[str], out) -> list[str]:
    return ["export", *argv, "--to_onnx", "true", "--output_dir", str(out)]


@pytest.fixture(scope="module")
def tiny_onnx(tiny_model_dir, tmp_path_factory):
    """The tiny model exported once through the CLI: (folder, printed output)."""
    out = tmp_path_factory.mktemp("onnx") / "tiny"
    printed = io.StringIO()  # capsys is function-scoped; a module fixture captures by hand
    with contextlib.redirect_stdout(printed):
        code = main(_export(["--model", str(tiny_model_dir)], out))
    assert code == 0, printed.getvalue()
    return out, printed.getvalue()


def _session(folder):
    import onnxruntime

    return onnxruntime.InferenceSession(
        str(folder / "model.onnx"), providers=["CPUExecutionProvider"]
    )


def _left_padded(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """A left-padded batch with the positions generate would use (pads skipped)."""
    # padding_side per call: the tokenizer fixture is shared with other test modules.
    batch = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": positions}


def _past_inputs(session) -> list:
    return [node for node in session.get_inputs() if node.name.startswith("past_key_values.")]


def _run(session, inputs, past=None) -> tuple[torch.Tensor, list]:
    """(logits, present key/values) for `inputs` after `past` (none: an empty cache)."""
    import numpy as np

    batch = inputs["input_ids"].shape[0]
    nodes = _past_inputs(session)
    if past is None:
        past = [np.zeros((batch, n.shape[1], 0, n.shape[3]), np.float32) for n in nodes]
    feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
    feeds.update((node.name, array) for node, array in zip(nodes, past, strict=True))
    logits, *present = session.run(None, feeds)
    return torch.from_numpy(logits), present


def _onnx_logits(session, inputs) -> torch.Tensor:
    return _run(session, inputs)[0]


@torch.no_grad()
def _torch_logits(folder, inputs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model(**inputs, use_cache=False).logits


def _assert_close(got, reference, mask):
    """onnxruntime's float32 kernels against torch's on the real (unpadded) tokens: the same
    sums in other orders, behind the tiny Llama's chain over the row (tests/tolerance.py); a
    logit's terms are the size of the largest logit."""
    keep = mask.bool()
    got, reference = got[keep], reference[keep]
    size, terms = float(reference.abs().max()), forward_terms(tokens=mask.shape[1])
    assert_close(got, reference, terms=terms, magnitude=size, what="ONNX logits")


def test_cli_writes_a_self_contained_checked_folder(tiny_onnx):
    out, printed = tiny_onnx
    assert CHECK_LINE in printed and "cache fed back) match 5/5" in printed
    assert "ONNX model written to" in printed
    for name in ("model.onnx", "model.onnx.data", "config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    # Optimum's layout: named inputs and outputs, KV cache included, batch/sequence axes dynamic.
    session = _session(out)
    inputs = {node.name: (node.shape, node.type) for node in session.get_inputs()}
    past = [f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *past]
    assert inputs["input_ids"] == (["batch", "sequence"], "tensor(int64)")
    assert inputs["position_ids"] == (["batch", "sequence"], "tensor(int64)")
    assert inputs["attention_mask"] == (["batch", "total_sequence"], "tensor(int64)")
    # The tiny Llama: 2 key/value heads of 64 / 4 = 16 dimensions.
    assert inputs[past[0]] == (["batch", 2, "past_sequence", 16], "tensor(float)")
    outputs = {node.name: node.shape for node in session.get_outputs()}
    assert list(outputs) == [
        "logits",
        *(name.replace("past_key_values", "present") for name in past),
    ]
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    assert outputs["logits"] == ["batch", "sequence", vocab_size]
    assert outputs["present.0.key"] == ["batch", 2, "past_sequence + sequence", 16]


@pytest.mark.parametrize(
    "texts",
    [
        # 3 rows, left-padded: other batch size, other lengths, positions that skip pads.
        ["Hello!", "Tell me a story about a cat.", "What is the capital of France? Paris."],
        # 1 row, longer than anything traced or checked.
        [" ".join(row["messages"][1]["content"] for row in CHAT_ROWS[:8])],
        # A single token.
        ["a"],
    ],
    ids=["left-padded-3", "long-1", "one-token"],
)
@pytest.mark.numerics
def test_onnx_logits_match_torch_on_new_shapes(tiny_onnx, tiny_model_dir, tiny_tokenizer, texts):
    out, _ = tiny_onnx
    inputs = _left_padded(tiny_tokenizer, texts)
    _assert_close(
        _onnx_logits(_session(out), inputs),
        _torch_logits(tiny_model_dir, inputs),
        inputs["attention_mask"],
    )


@pytest.mark.numerics
def test_position_ids_input_is_honoured(tiny_onnx, tiny_model_dir, tiny_tokenizer):
    # RoPE only sees position differences, so a shifted row would look right even if the graph
    # ignored position_ids; spread positions change the logits, and both sides must agree.
    out, _ = tiny_onnx
    inputs = _left_padded(tiny_tokenizer, ["Hello!", "Tell me a story about a cat."])
    spread = {**inputs, "position_ids": inputs["position_ids"] * 3}
    expected = _torch_logits(tiny_model_dir, spread)
    _assert_close(_onnx_logits(_session(out), spread), expected, inputs["attention_mask"])
    assert (expected - _torch_logits(tiny_model_dir, inputs)).abs().max() > 1e-3


@pytest.mark.numerics
def test_cache_fed_back_gives_the_full_sequence_logits(tiny_onnx, tiny_model_dir, tiny_tokenizer):
    # A left-padded batch of 2 prompts, then 3 tokens at once, then 4 one at a time, each step
    # after the cache of the steps before: the logits must be those of one no-cache pass
    # over the whole sequence.
    out, _ = tiny_onnx
    session = _session(out)
    prompt = _left_padded(tiny_tokenizer, ["Hello!", "Tell me a story about a cat."])
    extra = tiny_tokenizer(" The quick brown fox", return_tensors="pt")["input_ids"][:, :7]
    extra = extra.expand(2, -1)
    assert extra.shape[1] == 7
    ids = torch.cat([prompt["input_ids"], extra], dim=1)
    mask = torch.cat([prompt["attention_mask"], torch.ones_like(extra)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    whole = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    expected = _torch_logits(tiny_model_dir, whole)
    start, past = 0, None
    for end in (
        prompt["input_ids"].shape[1],
        ids.shape[1] - 4,
        *range(ids.shape[1] - 3, ids.shape[1] + 1),
    ):
        step = {
            "input_ids": ids[:, start:end],
            "attention_mask": mask[:, :end],
            "position_ids": positions[:, start:end],
        }
        logits, past = _run(session, step, past)
        _assert_close(logits, expected[:, start:end], mask[:, start:end])
        start = end
    assert start == ids.shape[1]


def test_check_rejects_a_file_that_differs(tiny_onnx, tiny_model_dir, tmp_path):
    # Every weight 1% off: the exporter's own check must refuse the file.
    import numpy as np
    from transformers import AutoModelForCausalLM

    from swiftlm.errors import ExportCheckError
    from swiftlm.models.loader import load_tokenizer

    folder = tmp_path / "tampered"
    shutil.copytree(tiny_onnx[0], folder)
    data = folder / "model.onnx.data"  # float32 weights only; small constants stay inline
    (np.fromfile(data, np.float32) * 1.01).tofile(data)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with pytest.raises(ExportCheckError, match="logits differ"):
        onnx_check.check_export(model, load_tokenizer(str(tiny_model_dir)), folder / "model.onnx")


@pytest.mark.numerics
def test_lora_run_is_merged_then_exported(
    tiny_model_dir, tiny_tokenizer, tiny_lora_run, tmp_path, capsys
):
    out = tmp_path / "onnx"
    assert main(_export(["--ckpt_dir", str(tiny_lora_run)], out)) == 0
    assert CHECK_LINE in capsys.readouterr().out
    # The ONNX logits are base + adapter's (read from the merged weights), not the base's.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    inputs = _left_padded(tiny_tokenizer, ["Question number 3?", "Hi"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(**inputs).logits
        tuned = PeftModel.from_pretrained(base, tiny_lora_run / "final").eval()
        expected = tuned(**inputs).logits
    got = _onnx_logits(_session(out), inputs)
    _assert_close(got, expected, inputs["attention_mask"])
    assert (expected - base_logits).abs().max() > 1e-2  # the adapter changed something


class OneLayerCache(torch.nn.Module):
    """A stand-in causal LM, tiny so that the exporter fails in a second: each token's id is
    its own key, value and logit, kept in a one-layer DynamicCache."""

    def __init__(self, branch_on_values: bool = False, tuple_cache: bool = False):
        from transformers import LlamaConfig

        super().__init__()
        self.config = LlamaConfig(vocab_size=16, num_hidden_layers=1)
        self.branch_on_values, self.tuple_cache = branch_on_values, tuple_cache

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True):
        from transformers import DynamicCache

        if self.branch_on_values and input_ids.sum() < 0:  # torch.export cannot trace this
            input_ids = -input_ids
        states = input_ids.float()[:, None, :, None]
        cache = past_key_values if past_key_values is not None else DynamicCache()
        keys, values = cache.update(states, states, 0)
        if self.tuple_cache:
            cache = ((keys, values),)
        return SimpleNamespace(logits=input_ids.float()[..., None], past_key_values=cache)


@pytest.mark.parametrize(
    "flags, says",
    [({"branch_on_values": True}, "not traceable"), ({"tuple_cache": True}, "DynamicCache")],
    ids=["data-dependent", "tuple-cache"],
)
def test_unsupported_model_error_names_model_and_fallbacks(tmp_path, flags, says):
    model = OneLayerCache(**flags)
    with pytest.raises(onnx_graph.OnnxExportError) as raised:
        onnx_export.export_graph(model, tmp_path / "model.onnx", "my-odd-model")
    message = str(raised.value)
    assert says in message and "my-odd-model" in message
    assert "--merge_lora" in message and "--to_gguf" in message
    assert "\x1b[" not in message and len(message.splitlines()) == 1


def test_flags_are_checked_before_loading(monkeypatch, tmp_path, capsys):
    # A model that does not exist: each error must come from validate(), before any load.
    missing = ["--model", str(tmp_path / "no-such-model")]
    assert main([*_export(missing, tmp_path / "a"), "--torch_dtype", "float16"]) == 2
    assert "--torch_dtype float16" in capsys.readouterr().err
    monkeypatch.setattr(onnx_export, "_importable", lambda name: name != "onnxruntime")
    assert main(_export(missing, tmp_path / "b")) == 2
    err = capsys.readouterr().err
    assert "onnxruntime" in err and "pip install 'swiftlm[onnx]'" in err


@pytest.mark.numerics
@pytest.mark.slow
def test_default_model_exports_and_checks(tmp_path, capsys):
    """The packaged SmolLM2-135M-Instruct: ~540 MB of float32, minutes on 2 cores."""
    from swiftlm.export.checks import perplexity
    from swiftlm.models.loader import load_model, load_tokenizer, resolve_model

    out = tmp_path / "onnx"
    assert main(["export", "--to_onnx", "true", "--output_dir", str(out)]) == 0
    assert CHECK_LINE in capsys.readouterr().out
    assert (out / "model.onnx.data").stat().st_size > 500e6
    # Held-out perplexity through onnxruntime equals the torch model's.
    path = resolve_model(None).path
    tokenizer = load_tokenizer(path)
    model = load_model(path, torch.float32, torch.device("cpu"))
    onnx_ppl = perplexity(onnx_check.OnnxCausalLM(out / "model.onnx"), tokenizer)
    # log perplexity is a mean NLL, behind SmolLM2-135M's chain over 512-token windows.
    smollm2 = dict(hidden=576, intermediate=1536, layers=30, head_dim=64, vocab=49152)
    terms = forward_terms(512, **smollm2)
    want = math.log(perplexity(model, tokenizer))
    assert_close(math.log(onnx_ppl), want, terms=terms, what="held-out log-perplexity")
