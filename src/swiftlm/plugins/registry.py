"""The register_* functions: each checks what a plugin gives, wraps it so that its failures
name the plugin, and adds it to the plain-dict registry of the layer that uses it."""

import inspect
from collections.abc import Callable

from swiftlm.plugins.context import PluginError, current_plugin
from swiftlm.plugins.guards import check_callable, guarded

BUILT_IN = "swiftlm (built in)"
# (kind, name) -> the plugin that registered it, for the duplicate-name error.
_OWNERS: dict[tuple[str, str], str] = {}


def _owner(kind: str, name: str, registry: dict) -> str | None:
    if (kind, name) in _OWNERS:
        return _OWNERS[(kind, name)]
    return BUILT_IN if name in registry else None


def _claim(kind: str, name: str, registry: dict, replace: bool) -> str:
    """The registering plugin's label, after refusing a name that is taken (unless `replace`)."""
    me = current_plugin()
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"{me}: a {kind} name must be a non-empty string, got {name!r}")
    owner = _owner(kind, name, registry)
    if owner is not None and not replace:
        raise PluginError(
            f"{me}: cannot register {kind} {name!r}: the name is already registered by {owner}; "
            "choose another name, or pass replace=True to replace it"
        )
    _OWNERS[(kind, name)] = me
    return me


def register_dataset_format(
    name: str,
    convert: Callable[[dict], dict],
    detect: Callable[[dict], bool] | None = None,
    *,
    replace: bool = False,
) -> None:
    """A dataset format: `convert(row) -> row` in a built-in format (`{"messages": [...]}`,
    ShareGPT, Alpaca, query/response, or `{"text": ...}` for pt); `detect(row) -> bool` lets
    rows in no built-in format be recognized (without it: only with --dataset_format NAME)."""
    from swiftlm.data.row_formats import ROW_FORMATS, RowFormat

    me = _claim("dataset format", name, ROW_FORMATS, replace)
    check_callable(convert, f"dataset format {name!r} convert", me, "row")
    if detect is not None:
        check_callable(detect, f"dataset format {name!r} detect", me, "row")
        detect = guarded(detect, f"dataset format {name!r} (detect)", me)
    convert = guarded(convert, f"dataset format {name!r}", me)
    ROW_FORMATS[name] = RowFormat(convert=convert, detect=detect)


def register_loss(name: str, loss: Callable, *, replace: bool = False) -> None:
    """A token loss for sft/pt, chosen with `--loss_type NAME`: `loss(logits, targets)` ->
    0-d tensor, the SUM over label tokens. `logits` [rows, width, vocab] float32; `targets`
    [rows, width], already shifted (targets[:, t] is the token logits[:, t] predicts), -100
    where no loss. swiftlm divides by the step's label tokens (summed over micro-batches)."""
    from swiftlm.losses.causal_lm import TOKEN_LOSSES

    me = _claim("loss", name, TOKEN_LOSSES, replace)
    check_callable(loss, f"loss {name!r}", me, "logits", "targets")
    TOKEN_LOSSES[name] = guarded(loss, f"loss {name!r}", me)


def register_reward(name: str, reward: Callable, *, replace: bool = False) -> None:
    """A GRPO reward function, chosen with `--reward_funcs NAME`: called once per rollout
    batch as `reward(prompts=, completions=, completion_ids=, **row_columns)` -> one float
    per completion (TRL's convention). A reward that raises stops the run, naming the plugin."""
    from swiftlm.methods.rl.rewards import REWARD_FUNCS

    me = _claim("reward function", name, REWARD_FUNCS, replace)
    if ":" in name:
        raise PluginError(f"{me}: reward name {name!r} must not contain ':' (file.py:function)")
    check_callable(
        reward, f"reward {name!r}", me, needs_kwargs=True, prompts=[], completions=[],
        completion_ids=[],
    )  # fmt: skip
    guarded_reward = guarded(reward, f"reward function {name!r}", me)
    REWARD_FUNCS[name] = lambda grpo_args: guarded_reward  # the same function whatever the flags


def register_method(
    name: str,
    method_class: type,
    *,
    rlhf: bool = False,
    loss_types: tuple[str, ...] = (),
    beta: float | None = None,
    reads: tuple[str, ...] = (),
    replace: bool = False,
) -> None:
    """A training method (`methods.base.Method`: to_sample, encode, collate, normalizer,
    loss ...), built per run as `method_class(cfg, tokenizer)`. With `rlhf=True` it is run
    by `swiftlm rlhf --rlhf_type NAME` (cfg an RLHFConfig); `loss_types` are the values its
    `--loss_type` accepts (the first is the default; none: the flag is refused), `beta` the
    default of `--beta` (None: the flag is refused) and `reads` the other flags of the rlhf,
    grpo and gkd sections it reads (e.g. "ref_model"; any other one given is refused). From
    Python, any registered method runs with `swiftlm.train.run.run(cfg, NAME)`."""
    from swiftlm.methods.base import missing_members
    from swiftlm.methods.registry import METHODS

    me = _claim("training method", name, METHODS, replace)
    if not inspect.isclass(method_class):
        raise PluginError(f"{me}: training method {name!r} must be a class, got {method_class!r}")
    missing = missing_members(method_class)
    if missing:
        raise PluginError(
            f"{me}: training method {name!r} ({method_class.__name__}) lacks {', '.join(missing)} "
            "(see swiftlm.methods.base.Method)"
        )
    flags = _rlhf_flags(me, name, tuple(loss_types), beta, tuple(reads)) if rlhf else None
    METHODS[name] = method_class
    if flags is not None:
        from swiftlm.methods.config import RLHF_METHODS

        RLHF_METHODS[name] = flags  # a choice of --rlhf_type from now on


def _rlhf_flags(me: str, name: str, loss_types, beta, reads):
    """The method's `MethodFlags`, after checking that each flag it reads exists."""
    from dataclasses import fields

    from swiftlm.methods.config import RLHFArguments
    from swiftlm.methods.flags import MethodFlags
    from swiftlm.methods.rl.config import GKDArguments, GRPOArguments

    known = {
        f.name for section in (RLHFArguments, GRPOArguments, GKDArguments) for f in fields(section)
    }
    unknown = [flag for flag in reads if flag not in known]
    if unknown:
        raise PluginError(
            f"{me}: training method {name!r} reads {', '.join(unknown)}, which no section of "
            f"swiftlm rlhf has (its flags: {', '.join(sorted(known))})"
        )
    return MethodFlags(loss_types=loss_types, beta=beta, reads=frozenset(reads))


def register_chat_template(model_type: str, template: str, *, replace: bool = False) -> None:
    """A Jinja chat template used for every model whose config.json `model_type` is
    `model_type`, instead of the tokenizer's own (training, inference, serving)."""
    from swiftlm.models.templates import CHAT_TEMPLATES

    me = _claim("chat template", model_type, CHAT_TEMPLATES, replace)
    if not isinstance(template, str) or "{%" not in template and "{{" not in template:
        raise PluginError(f"{me}: chat template {model_type!r} must be a Jinja template string")
    CHAT_TEMPLATES[model_type] = template


def register_tool_parser(
    name: str,
    parser: Callable,
    *,
    forced_call_tags: tuple[str, str] | None = None,
    replace: bool = False,
) -> None:
    """A tool-call parser for `swiftlm deploy --tool_call_parser NAME`: `parser(text) ->
    (content, [serve.tools.ParsedCall, ...])`, the generated text split into its plain content
    and its calls. `forced_call_tags=(begin, end)`: the text around one call's JSON, which
    lets the server force a call (tool_choice "required" or a named function)."""
    from swiftlm.serve.tools import FORCED_CALL_TAGS, TOOL_PARSERS

    me = _claim("tool parser", name, TOOL_PARSERS, replace)
    check_callable(parser, f"tool parser {name!r}", me, "text")
    if forced_call_tags is not None and (
        not isinstance(forced_call_tags, tuple)
        or len(forced_call_tags) != 2
        or not all(isinstance(tag, str) for tag in forced_call_tags)
    ):
        raise PluginError(f"{me}: forced_call_tags of tool parser {name!r} must be (begin, end)")
    TOOL_PARSERS[name] = guarded(parser, f"tool parser {name!r}", me)
    FORCED_CALL_TAGS.pop(name, None)
    if forced_call_tags is not None:
        FORCED_CALL_TAGS[name] = forced_call_tags


def register_eval_task(name: str, build: Callable, *, replace: bool = False) -> None:
    """An evaluation task for `swiftlm eval --eval_dataset NAME`: `build(placeholders)` ->
    an `evaluation.tasks.Task` (`placeholders` fills {{NAME}}/{{AUTHOR}} in its texts)."""
    from swiftlm.evaluation.task_file import BUILTIN_TASKS

    me = _claim("eval task", name, BUILTIN_TASKS, replace)
    check_callable(build, f"eval task {name!r}", me, "placeholders")
    BUILTIN_TASKS[name] = guarded(build, f"eval task {name!r}", me)


def register_model_loader(
    name: str,
    load: Callable,
    *,
    model_types: tuple[str, ...] = (),
    prefix: str | None = None,
    replace: bool = False,
) -> None:
    """A model loader for local folders whose config.json `model_type` is in `model_types`,
    or --model values starting with `prefix`: `load(path, dtype=, device=, attn_impl=,
    kind=)` -> a torch module (swiftlm moves it to `device`). The tokenizer still loads
    from `path` with transformers."""
    from swiftlm.models.loader import MODEL_LOADERS, ModelLoader

    me = _claim("model loader", name, MODEL_LOADERS, replace)
    if not model_types and not prefix:
        raise PluginError(f"{me}: model loader {name!r} needs model_types or a prefix")
    keywords = dict(dtype=None, device=None, attn_impl="sdpa", kind="causal_lm")
    check_callable(load, f"model loader {name!r}", me, "path", **keywords)
    loader = guarded(load, f"model loader {name!r}", me)
    MODEL_LOADERS[name] = ModelLoader(loader, tuple(model_types), prefix)


def register_callback(
    name: str, callback, *, all_ranks: bool = False, replace: bool = False
) -> None:
    """A training callback: an object (or a class, built without arguments) with any of
    `on_train_start(run_dir, step, num_steps)`, `on_step_end(step, loss, learning_rate,
    grad_norm)`, `on_save(step, path)`, `on_train_end(step, summary)`, called with keyword
    arguments on rank 0 (every rank with `all_ranks=True`). One that raises stops the run."""
    from swiftlm.train.callbacks import CALLBACKS, HOOKS, Callback

    me = _claim("callback", name, CALLBACKS, replace)
    if inspect.isclass(callback):
        callback = callback()
    arguments = {
        "on_train_start": ("run_dir", "step", "num_steps"),
        "on_step_end": ("step", "loss", "learning_rate", "grad_norm"),
        "on_save": ("step", "path"),
        "on_train_end": ("step", "summary"),
    }
    hooks = {hook: getattr(callback, hook) for hook in HOOKS if hasattr(callback, hook)}
    if not hooks:
        raise PluginError(f"{me}: callback {name!r} has none of {', '.join(HOOKS)}")
    for hook, method in hooks.items():
        check_callable(method, f"callback {name!r} {hook}", me, **dict.fromkeys(arguments[hook]))
    wrapped = type("GuardedCallback", (), {})()
    for hook, method in hooks.items():
        setattr(wrapped, hook, guarded(method, f"callback {name!r} ({hook})", me))
    CALLBACKS[name] = Callback(wrapped, all_ranks)


def registered_by(kind: str, name: str) -> str | None:
    """The plugin that registered `name` as a `kind` ("loss", "reward function", ...)."""
    return _OWNERS.get((kind, name))
