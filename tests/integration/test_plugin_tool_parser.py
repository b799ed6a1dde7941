"""A tool-call parser from a plugin file serves `swiftlm deploy --tool_call_parser NAME`: forced
calls are generated in the plugin's own tags and read back by its parser (tiny random model,
the grammar makes the calls), and the names it cannot serve are clear errors."""

import json

import pytest

from conftest import build_tiny_llama, build_tokenizer
from plugin_isolation import isolated_plugins  # noqa: F401 (a fixture)
from tool_templates import TOOL_CHATML

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import ServerThread  # noqa: E402

PLUGIN = """
import json, re
import swiftlm.plugins as plugins
from swiftlm.serve.tools import ParsedCall

CALL = re.compile(r"<<call>>(.*?)<</call>>", re.S)

def parse(text):
    calls = [json.loads(body) for body in CALL.findall(text)]
    return CALL.sub("", text).strip(), [ParsedCall(c["name"], c["arguments"]) for c in calls]

plugins.register_tool_parser("angle", parse, forced_call_tags=("<<call>>", "<</call>>"))
plugins.register_tool_parser("untagged", parse)
"""
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def serve(model_dir, parser):
    from swiftlm.engine.build import build_engine
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    engine = build_engine(str(model_dir), max_num_seqs=4, max_model_len=1024, seed=0)
    settings = ServerSettings(tool_call_parser=parser)
    return engine, generation_app(engine, engine.tokenizer, ServedModels("tiny"), settings)


@pytest.fixture
def model_dir(tmp_path):
    tokenizer = build_tokenizer(tmp_path, chat_template=TOOL_CHATML)
    build_tiny_llama(tmp_path, vocab_size=len(tokenizer))
    return tmp_path


def test_a_plugin_parser_forces_and_reads_calls_in_its_own_tags(
    isolated_plugins,  # noqa: F811
    model_dir,
    tmp_path,
):
    from swiftlm.plugins import load_plugins

    (tmp_path / "angle_plugin.py").write_text(PLUGIN)
    load_plugins([str(tmp_path / "angle_plugin.py")])
    engine, app = serve(model_dir, "angle")
    try:
        with ServerThread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            answer = client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3, seed=1
            )
    finally:
        engine.shutdown()
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), CITY)


@pytest.mark.bad_input(
    input="a forced tool call (`tool_choice: required`) on a server whose --tool_call_parser "
    "(a plugin's) has no forced_call_tags",
    outcome="400 on `tool_choice` naming the parser and the two ways out",
)
def test_a_parser_without_tags_cannot_force_a_call(isolated_plugins, model_dir, tmp_path):  # noqa: F811
    from swiftlm.plugins import load_plugins

    (tmp_path / "angle_plugin.py").write_text(PLUGIN)
    load_plugins([str(tmp_path / "angle_plugin.py")])
    engine, app = serve(model_dir, "untagged")
    try:
        with ServerThread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(
                    model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required"
                )
    finally:
        engine.shutdown()
    assert "'untagged' does not" in str(caught.value) and "forced_call_tags" in str(caught.value)


@pytest.mark.bad_input(
    input="`swiftlm deploy --tool_call_parser NAME` that no plugin registered",
    outcome="Exit 2 before the model loads, listing the known parsers",
)
def test_an_unknown_tool_call_parser_fails_before_loading(capsys):
    from swiftlm.cli.main import main

    assert main(["deploy", "--model", "/nowhere", "--tool_call_parser", "mine"]) == 2
    assert "--tool_call_parser mine: no such parser; known: hermes" in capsys.readouterr().err
