"""`swiftlm export --to_ollama`: an Ollama Modelfile next to the GGUF file.

Ollama formats a chat with a Go template, not the model's Jinja chat template. A Jinja
template is recognised by what it renders, not by its text: two probe conversations (with and
without a system prompt) are rendered with it and compared with what each known Go template
renders for them (computed here in Python). When one matches exactly, its Go template is
written; a default system prompt the Jinja template adds by itself (SmolLM2's "You are a helpful
AI assistant named SmolLM...") becomes the Modelfile's SYSTEM unless the run has its own.
Otherwise TEMPLATE is left out and Ollama falls back to the template it detects from the
`tokenizer.chat_template` in the GGUF metadata.

Known families: ChatML (SmolLM2, Qwen2, swiftlm's default; closed by `<|im_end|>` or by the
tokenizer's EOS) and Llama 3 (header tokens, `<|eot_id|>`).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from swiftlm.export.gguf_tokenizer import adds_special_tokens
from swiftlm.models.templates import end_of_turn_token

PROBE_SYSTEM = "You are a probe assistant."
PROBE_TURNS = [
    ("user", "Hello there."),
    ("assistant", "Hi! How can I help?"),
    ("user", "Tell me a joke."),
]
SYSTEM_MARK = "\x00system\x00"  # stands for the system prompt when locating a default one


@dataclass(frozen=True)
class ChatFamily:
    """A chat format built from a header per role, each turn closed by the end-of-turn token
    and then `after_end`: the Go template and the Python rendering come from the same parts."""

    name: str
    header: Callable[[str], str]  # role -> what opens its turn
    after_end: str  # what follows the end-of-turn token
    stops: Callable[[str], list[str]]  # end-of-turn token -> PARAMETER stop values
    end_tokens: tuple[str, ...]  # candidate end-of-turn tokens ("" = the tokenizer's EOS)

    def go_template(self, end: str) -> str:
        """The Ollama TEMPLATE, closing turns with `end`."""
        close = end + self.after_end
        return (
            "{{ if .System }}" + self.header("system") + "{{ .System }}" + close + "{{ end }}"
            "{{ range .Messages }}"
            '{{ if eq .Role "user" }}'
            + self.header("user")
            + "{{ .Content }}"
            + close
            + self.header("assistant")
            + '{{ else if eq .Role "assistant" }}{{ .Content }}'
            + close
            + "{{ end }}{{ end }}"
        )

    def render(self, system: str | None, turns: list, end: str) -> str:
        """What go_template(end) produces for `system` and `turns`."""
        close = end + self.after_end
        text = f"{self.header('system')}{system}{close}" if system else ""
        for role, content in turns:
            if role == "user":
                text += f"{self.header('user')}{content}{close}{self.header('assistant')}"
            else:
                text += f"{content}{close}"
        return text


FAMILIES = [
    ChatFamily(
        "ChatML",
        lambda role: f"<|im_start|>{role}\n",
        "\n",
        lambda end: [end, "<|im_start|>"],
        ("<|im_end|>", ""),
    ),
    ChatFamily(
        "Llama 3",
        lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n",
        "",
        lambda end: [end, "<|start_header_id|>", "<|end_header_id|>"],
        ("<|eot_id|>",),
    ),
]


@dataclass(frozen=True)
class OllamaChat:
    family: str
    template: str  # the Go template
    stops: list[str]
    default_system: str | None  # a system prompt the Jinja template adds when none is given


def _render_jinja(tokenizer, system: str | None) -> str | None:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": role, "content": content} for role, content in PROBE_TURNS]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # templates raise on what they do not support, e.g. a system turn
        return None


def _default_system(family: ChatFamily, end: str, rendered: str) -> tuple[bool, str | None]:
    """(matches, default system prompt) for the Jinja rendering of the probe without one."""
    if rendered == family.render(None, PROBE_TURNS, end):
        return True, None
    before, after = family.render(SYSTEM_MARK, PROBE_TURNS, end).split(SYSTEM_MARK)
    if (
        rendered.startswith(before)
        and rendered.endswith(after)
        and len(rendered) > len(before + after)
    ):
        return True, rendered[len(before) : len(rendered) - len(after)]
    return False, None


def _match(tokenizer, with_system: str, without_system: str) -> OllamaChat | None:
    """The known family whose Go template renders both probes as the Jinja template did."""
    for family in FAMILIES:
        for end in family.end_tokens:
            end = end or tokenizer.eos_token or ""
            if not end or with_system != family.render(PROBE_SYSTEM, PROBE_TURNS, end):
                continue
            matches, default = _default_system(family, end, without_system)
            if matches:
                stops = list(dict.fromkeys(family.stops(end)))
                return OllamaChat(family.name, family.go_template(end), stops, default)
    return None


def recognise(tokenizer) -> OllamaChat | None:
    """The Go template that renders like `tokenizer`'s chat template, if there is one."""
    with_system = _render_jinja(tokenizer, PROBE_SYSTEM)
    without_system = _render_jinja(tokenizer, None)
    if with_system is None or without_system is None:
        return None
    bos = tokenizer.bos_token
    # A template may open with a literal BOS (Llama 3's "{{ bos_token }}"): try the rest too.
    prefixes = [""] + [bos] if bos and with_system.startswith(bos) else [""]
    for prefix in prefixes:
        if not without_system.startswith(prefix):
            continue
        chat = _match(tokenizer, with_system[len(prefix) :], without_system[len(prefix) :])
        if chat is None:
            continue
        # llama.cpp adds BOS itself when the tokenizer does; otherwise the template writes it
        literal = "" if prefix and adds_special_tokens(tokenizer)[0] else prefix
        return replace(chat, template=literal + chat.template)
    return None


def _quoted(text: str) -> str | None:
    """`text` as a Modelfile triple-quoted string (which has no escapes)."""
    return None if '"""' in text else f'"""{text}"""'


def modelfile_text(gguf_file: str, tokenizer, system: str | None) -> tuple[str, OllamaChat | None]:
    chat = recognise(tokenizer)
    lines = ["# Ollama Modelfile written by swiftlm export: ollama create NAME -f Modelfile", ""]
    lines.append(f"FROM ./{gguf_file}")
    if chat is not None:
        lines.append(f"TEMPLATE {_quoted(chat.template)}")
    stops = chat.stops if chat else [end_of_turn_token(tokenizer)]
    lines += [f'PARAMETER stop "{stop}"' for stop in stops if stop and '"' not in stop]
    system = system or (chat.default_system if chat else None)
    if system and _quoted(system):
        lines.append(f"SYSTEM {_quoted(system)}")
    return "\n".join(lines) + "\n", chat


def write_modelfile(gguf_path: Path, tokenizer, system: str | None) -> Path:
    """Write `Modelfile` next to `gguf_path` and say what it holds."""
    text, chat = modelfile_text(gguf_path.name, tokenizer, system)
    path = gguf_path.parent / "Modelfile"
    path.write_text(text, encoding="utf-8")
    if chat is not None:
        print(f"wrote {path}: {chat.family} TEMPLATE, stop on {', '.join(chat.stops)}")
    else:
        print(
            f"wrote {path} without TEMPLATE: the chat template is none this exporter can "
            "translate to Ollama's Go syntax, so Ollama will fall back to the template it "
            "detects in the GGUF metadata (tokenizer.chat_template)"
        )
    return path
