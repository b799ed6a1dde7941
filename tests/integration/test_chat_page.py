"""The chat page at `GET /` in headless Chromium over the real server and a tiny model: it lists
the models with the typed API key, streams an answer equal to the API's at temperature 0, keeps
the conversation for the next turn, shows tokens/s, and clears."""

import json
import shutil

import httpx
import pytest

pytest.importorskip("fastapi")

from cdp_helpers import Browser, chromium_path  # noqa: E402
from serve_helpers import ServerThread  # noqa: E402

KEY = "page-key"
# The random tiny model seldom ends an answer: without a cap, the first answer fills the
# context (256 tokens) and the second turn's prompt no longer fits (the page shows the 400).
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_lora_run):
    if chromium_path() is None:
        pytest.skip("chromium is not installed (.ci/run installs it with apt-get as root)")
    from swiftlm.engine.build import build_engine
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    adapters = {"my-run": str(tiny_lora_run / "final")}
    engine = build_engine(
        str(tiny_model_dir), adapters=adapters, max_num_seqs=4, max_model_len=256, seed=0
    )
    settings = ServerSettings(api_keys=(KEY,))
    app = generation_app(engine, engine.tokenizer, ServedModels("tiny", ("my-run",)), settings)
    with ServerThread(app) as url:
        yield url
    engine.shutdown()


def api_answer(url: str, messages: list) -> str:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def ask(page: Browser, text: str, turn: int) -> str:
    """Type `text`, send it, wait for the streamed answer of turn `turn` (1-based)."""
    page.eval(f"document.getElementById('message').value = {json.dumps(text)}")
    page.eval("document.getElementById('send').click()")
    n = 2 * turn
    page.wait_for(f"document.getElementById('answer-{n - 1}')?.dataset.done === 'true'")
    return page.eval(f"document.getElementById('answer-{n - 1}').textContent")


def test_the_page_streams_the_apis_answer_and_keeps_the_conversation(server, tmp_path):
    assert httpx.get(f"{server}/").headers["content-type"].startswith("text/html")
    with Browser(f"{server}/", tmp_path / "profile") as page:
        page.wait_for("document.readyState === 'complete'")
        # Without the key the page says so; with it, the models appear.
        page.wait_for("document.querySelector('#log .error')")
        page.eval(
            f"const k = document.getElementById('api-key'); k.value = {json.dumps(KEY)};"
            "k.dispatchEvent(new Event('change')); document.getElementById('clear').click()"
        )
        page.wait_for("document.getElementById('model').options.length === 2")
        options = page.eval("[...document.getElementById('model').options].map(o => o.value)")
        assert options == ["tiny", "my-run"]
        page.eval("document.getElementById('temperature').value = '0'")
        page.eval(f"document.getElementById('max-tokens').value = '{MAX_TOKENS}'")

        # Count the answer's text updates: a streamed answer is set chunk by chunk.
        page.eval(
            "window.updates = 0; new MutationObserver((records) => { for (const r of records)"
            " if (r.target.classList.contains('assistant')) window.updates++; })"
            ".observe(document.getElementById('log'), {childList: true, subtree: true})"
        )
        first = ask(page, "Who are you?", turn=1)
        assert page.eval("window.updates") > 1
        assert first and first == api_answer(server, [{"role": "user", "content": "Who are you?"}])
        second = ask(page, "Tell me a story", turn=2)
        history = [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Tell me a story"},
        ]
        assert second == api_answer(server, history)
        stats = page.eval("document.getElementById('stats-4').textContent")
        assert "tokens/s" in stats, stats

        page.screenshot(tmp_path / "chat_page.png")
        shutil.copy(tmp_path / "chat_page.png", "/tmp/chat_page.png")
        page.eval("document.getElementById('clear').click()")
        assert page.eval("document.getElementById('log').children.length") == 0
