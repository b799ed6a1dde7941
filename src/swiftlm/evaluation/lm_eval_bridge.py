"""Run lm-evaluation-harness tasks on swiftlm's continuous-batching engine.

lm-eval's own Hugging Face backend (`--model hf`) generates in fixed batches: each batch is
left-padded to its longest prompt and decodes until its *last* sequence stops, so one long
answer holds up the rest. Here every `generate_until` request of a run goes to the engine at
once and each sequence ends at its own stop string, which is where the speed comes from.

Results are meant to be lm-eval's HF backend's, so scores compare with published ones: prompts
are tokenized, truncated and cut as `lm_eval/models/huggingface.py` does, and log-likelihoods
come from plain right-padded forwards of the engine's model, as HF computes them (differences:
`_EngineScoring`'s docstring). lm_eval is an optional extra (`pip install 'swiftlm[eval]'`),
imported only when a function here runs, never when swiftlm is imported.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from swiftlm.engine.packed_weights import parameter_count
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from swiftlm.errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'swiftlm[eval]'"
# Generation kwargs lm-eval tasks set that map onto `SamplingParams`; others are ignored.
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_LM_EVAL_BOOKKEEPING = ("do_sample", "max_length", "seed")


def require_lm_eval():
    """lm_eval, or a ConfigError telling how to install it."""
    try:
        import lm_eval
        import lm_eval.tasks  # noqa: F401  (TaskManager lives here)
    except ImportError as exc:
        raise ConfigError(
            f"lm-evaluation-harness tasks need the `lm_eval` package ({exc}); "
            f"install it with `{INSTALL_HINT}`"
        ) from exc
    return lm_eval


class _EngineScoring:
    """The whole lm-eval `TemplateLM` interface over a `ContinuousEngine`.

    A plain mixin so that swiftlm imports without lm_eval; `engine_lm` combines it with
    lm_eval's `TemplateLM` (which adds `loglikelihood`: the context/continuation split).

    Differences from lm-eval's HF backend:
    - log-softmax is taken in float32 (HF: in the model's dtype): identical for fp32 models,
      slightly more accurate for bf16/fp16 ones;
    - requests whose model inputs are identical share one forward (HF shares only
      one-token continuations); batch composition, hence float rounding, can differ;
    - a prompt that starts with BOS is encoded without special tokens per prompt (HF decides
      once per batch, from the batch's first prompt); an empty prompt becomes the prefix token;
    - generation may be at most the engine's `max_model_len` (prompt + new tokens): longer
      prompts are cut from the left to fit, like HF cuts to the model's length;
    - sampling (`do_sample` with temperature > 0) uses the engine's sampler, so sampled
      answers are not HF's; greedy answers are.
    """

    backend = "causal"

    def __init__(
        self,
        engine,
        *,
        batch_size: int = 16,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        chat_template_args: dict | None = None,
    ):
        from lm_eval.models.utils import resolve_max_length

        super().__init__()
        self.engine = engine
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.batch_size = batch_size
        self.add_bos_token = add_bos_token
        self.chat_template_args = chat_template_args or {}
        # The context HF's backend assumes: the config's, the tokenizer's, or 2048.
        self.max_length = max_length or resolve_max_length(self.model.config, self.tokenizer)
        self.max_gen_toks = 256  # when a task does not say (HF's default too)
        self._device = next(self.model.parameters()).device

    # -- what lm-eval reads -------------------------------------------------------------------

    @property
    def config(self):
        # simple_evaluate names the run after `config._name_or_path` when there is one.
        return self.model.config

    @property
    def device(self):
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": parameter_count(self.model),
            "model_dtype": str(self.model.dtype),
            "engine": "swiftlm ContinuousEngine",
        }

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True):
        """The prompt as HF's backend renders it (it retries without a system turn when the
        template refuses one)."""
        import jinja2

        options = dict(
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
            **self.chat_template_args,
        )
        try:
            return self.tokenizer.apply_chat_template(chat_history, **options)
        except jinja2.exceptions.TemplateError:
            log.warning("the chat template refused the system turn; retrying without it")
            turns = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(turns, **options)

    # -- tokenization, as lm-eval's HF backend does it ----------------------------------------

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        starts_with_bos = string.startswith(self.tokenizer.decode(self.prefix_token_id))
        ids = self.tokenizer.encode(string, **self._specials(add_special_tokens, starts_with_bos))
        left_truncate_len = kwargs.get("left_truncate_len")
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _specials(self, explicit: bool | None, starts_with_bos: bool) -> dict:
        """HF's rule for special tokens: as the caller says, else none for a text that already
        starts with BOS (a chat template's), else `add_bos_token`, else the tokenizer's way."""
        if explicit is None:
            explicit = False if starts_with_bos else self.add_bos_token
        return {} if explicit is None else {"add_special_tokens": explicit}

    def _generation_prompt(self, context: str, max_prompt: int) -> list[int]:
        """HF's `tok_batch_encode` for one prompt, then its last `max_prompt` tokens."""
        bos = self.tokenizer.bos_token
        options = self._specials(None, bool(bos) and context.startswith(bos))
        ids = self.tokenizer(context, **options)["input_ids"][-max_prompt:]
        return ids or [self.prefix_token_id]  # the engine needs at least one prompt token

    # -- log-likelihoods -------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of continuation log-probs, whether greedy decoding gives the continuation) for
        each (key, context ids, continuation ids), in order."""
        users: dict[tuple, list[int]] = {}  # a distinct model input -> the requests scoring it
        for index, (_, context, continuation) in enumerate(requests):
            users.setdefault(self._scored_input(context, continuation), []).append(index)
        results: list = [None] * len(requests)
        for window, logprobs, greedy in self._score_inputs(users, requests):
            for index in users[window]:
                key, _, continuation = requests[index]
                results[index] = _continuation_score(logprobs, greedy, continuation)
                if key is not None:  # rolling windows have no key: their sum is cached instead
                    self.cache_hook.add_partial("loglikelihood", key, results[index])
        return results

    def _scored_input(self, context: list[int], continuation: list[int]) -> tuple[int, ...]:
        """The model input: context + continuation minus its last token, cut from the left
        to `max_length` (so the last continuation token is still predicted)."""
        if not context or not continuation:
            raise ValueError("a log-likelihood request needs context and continuation tokens")
        if len(continuation) > self.max_length:  # HF's backend asserts the same
            raise ValueError(
                f"a continuation of {len(continuation)} tokens does not fit in max_length "
                f"{self.max_length}"
            )
        return tuple((context + continuation)[-(self.max_length + 1) :][:-1])

    @torch.inference_mode()
    def _score_inputs(self, users: dict[tuple, list[int]], requests):
        """Yield (input, log-probs [positions, vocab] in float32, greedy tokens) per distinct
        input, for the last positions its longest continuation needs only (a whole row is
        length x vocab floats). Right-padded batches, longest first, as HF's backend runs
        them: an out-of-memory error shows on the first batch."""
        unique = sorted(users, key=lambda ids: (-len(ids), ids))
        for start in range(0, len(unique), self.batch_size):
            batch = unique[start : start + self.batch_size]
            width = len(batch[0])
            padded = [list(ids) + [0] * (width - len(ids)) for ids in batch]
            tokens = torch.tensor(padded, dtype=torch.long, device=self.device)
            logits = self.model(tokens, use_cache=False).logits  # no KV cache to keep
            for row, ids in enumerate(batch):
                needed = max(len(requests[i][2]) for i in users[ids])
                scored = logits[row, len(ids) - needed : len(ids)].float()
                logprobs = torch.log_softmax(scored, dim=-1)
                yield ids, logprobs, logprobs.argmax(dim=-1)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in disjoint windows of `max_length` (lm-eval's
        `get_rolling_token_windows`, one token of context, BOS/EOS before the first)."""
        from lm_eval import utils

        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            pairs = utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[index] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """All requests go to the engine at once; each answer is cut at its first stop string
        (`until`, plus the EOS text) as HF's backend cuts it."""
        from lm_eval.models.utils import postprocess_generated_text

        jobs = [self._generation_job(*request.args) for request in requests]
        answers = self.engine.generate([request for request, _ in jobs])
        texts = []
        for request, (_, until), samples in zip(requests, jobs, answers, strict=True):
            # The tokens decoded whole, as HF decodes them, then cut at the first stop string.
            text = self.tok_decode(samples[0].token_ids)
            texts.append(postprocess_generated_text(text, until, None))
            self.cache_hook.add_partial("generate_until", request.args, texts[-1])
        return texts

    def _generation_job(self, context: str, gen_kwargs: dict):
        """The engine request for one lm-eval generation, and its stop strings."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        context_len = min(self.max_length, self.engine.max_model_len)
        if context_len <= max_gen_toks:
            raise ConfigError(
                f"max_gen_toks {max_gen_toks}: leaves no room for a prompt in {context_len} tokens"
            )
        params = SamplingParams(
            max_tokens=max_gen_toks,
            stop=tuple(until),
            # HF stops on the generation config's EOS ids and the EOS text, not on the
            # engine's chat end-of-turn token: name exactly those.
            ignore_eos=True,
            stop_token_ids=self.eos_token_ids,
            **_sampling_options(kwargs),
        )
        prompt = self._generation_prompt(context, context_len - max_gen_toks)
        return GenerationRequest(prompt, params), until

    @functools.cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """What ends an answer in HF's backend: the generation config's EOS ids (what
        `model.generate` stops on) and the tokenizer's EOS (its text is a stop string)."""
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = eos if isinstance(eos, list) else [eos]
        return tuple(sorted({i for i in [*ids, self.tokenizer.eos_token_id] if i is not None}))


def _continuation_score(logprobs, greedy, continuation: list[int]) -> tuple[float, bool]:
    """Sum of the continuation's log-probs and whether each was the argmax: the last
    `len(continuation)` scored positions predict it."""
    target = torch.tensor(continuation, device=logprobs.device)
    picked = logprobs[-len(continuation) :].gather(1, target.unsqueeze(1)).sum()
    return float(picked), bool((greedy[-len(continuation) :] == target).all())


def _sampling_options(kwargs: dict) -> dict:
    """SamplingParams fields from normalized lm-eval generation kwargs: greedy unless
    `do_sample` with a positive temperature (lm-eval's rule)."""
    options = {key: kwargs[key] for key in _SAMPLING_KEYS if kwargs.get(key) is not None}
    if not kwargs.get("do_sample") or not options.get("temperature"):
        options["temperature"] = 0.0
    ignored = sorted(set(kwargs) - set(_SAMPLING_KEYS) - set(_LM_EVAL_BOOKKEEPING))
    if ignored:
        log.warning("generation kwargs not supported by the swiftlm engine, ignored: %s", ignored)
    return options


@functools.cache
def _engine_lm_class():
    from lm_eval.api.model import TemplateLM

    return type("EngineLM", (_EngineScoring, TemplateLM), {"__doc__": _EngineScoring.__doc__})


def engine_lm(engine, **options):
    """An lm-eval `LM` over `engine` (options: batch_size, max_length, add_bos_token,
    chat_template_args), for `lm_eval.simple_evaluate(model=...)`."""
    require_lm_eval()
    return _engine_lm_class()(engine, **options)


# -- running tasks ---------------------------------------------------------------------------------


def run_lm_eval(
    engine,
    tasks: list[str],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    batch_size: int = 16,
    log_samples: bool = True,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = True,
    bootstrap_iters: int = 100000,
    prepared: tuple | None = None,
) -> dict:
    """Run lm-eval `tasks` (registered names, or local task `.yaml` files) on `engine`.

    Returns `lm_eval.simple_evaluate`'s dict: `results` (metrics per task, keys like
    `acc,none`: see `flatten_results`), `samples` (per-sample logs, with `log_samples`),
    `configs`, `versions`, `n-samples`. `seed` seeds python, numpy, torch and the few-shot
    sampler alike; `batch_size` is the log-likelihood batch (generation is batched by the
    engine's `max_num_seqs`). `apply_chat_template` renders prompts with the tokenizer's chat
    template (few-shot examples as turns unless `fewshot_as_multiturn` is false), as
    `lm_eval --apply_chat_template` does."""
    lm_eval = require_lm_eval()
    names, manager = prepared or prepare_tasks(tasks)
    lm = engine_lm(engine, batch_size=batch_size)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=log_samples,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        bootstrap_iters=bootstrap_iters,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        task_manager=manager,
    )


def prepare_tasks(tasks: list[str]) -> tuple[list[str], object]:
    """(task names, lm-eval's TaskManager) for `tasks`, every name checked: a caller can do
    this before loading the model, then pass it to `run_lm_eval(prepared=...)`."""
    names, folders = resolve_tasks(tasks)
    return names, task_manager(names, folders)


def resolve_tasks(tasks: list[str]) -> tuple[list[str], list[str]]:
    """Task names, and the folders of local task files (lm-eval's `include_path`)."""
    if not tasks:
        raise ConfigError("no lm-eval tasks given: name at least one (or a task .yaml file)")
    names, folders = [], []
    for spec in tasks:
        if spec.endswith((".yaml", ".yml")):
            path = Path(spec).expanduser()
            names.append(local_task_name(path))
            if str(path.resolve().parent) not in folders:
                folders.append(str(path.resolve().parent))
        else:
            names.append(spec)
    return names, folders


def local_task_name(path: Path) -> str:
    """The `task:` a local lm-eval task file defines."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"lm-eval task file {path}: not found")

    class _Loader(yaml.SafeLoader):
        """Reads lm-eval's `!function module.name` tags (as None: only `task:` is read)."""

    _Loader.add_multi_constructor("!", lambda loader, tag, node: None)
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"lm-eval task file {path}: not readable YAML ({exc})") from exc
    name = config.get("task") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"lm-eval task file {path}: it has no `task:` name")
    return name


def task_manager(names: list[str], folders: list[str]):
    """lm-eval's TaskManager over `folders` (and lm-eval's own tasks only when a name is not
    local: indexing those takes seconds); raises ConfigError naming unknown tasks."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=folders or None, include_defaults=False)
    if any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=folders or None)
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown:
        raise ConfigError(
            f"lm-eval task {', '.join(map(repr, unknown))}: not a task, group or tag lm-eval "
            "knows; check the name (`lm-eval ls tasks` lists them) or pass a task .yaml file"
        )
    return manager


def flatten_results(results: dict) -> dict[str, dict[str, Any]]:
    """`{task: {metric: value}}` from lm-eval's results (the whole `run_lm_eval` dict or its
    `results`): the `,none` filter suffix dropped (other filters kept, `exact_match,flexible`),
    stderrs and aliases left out (see `flatten_stderrs`)."""
    return {
        task: {_metric_name(k): v for k, v in metrics.items() if "," in k and "_stderr," not in k}
        for task, metrics in results.get("results", results).items()
    }


def flatten_stderrs(results: dict) -> dict[str, dict[str, float | None]]:
    """`{task: {metric: stderr}}`, named as in `flatten_results`; None where lm-eval has
    none ("N/A")."""
    return {
        task: {
            _metric_name(k.replace("_stderr,", ",")): None if v == "N/A" else v
            for k, v in metrics.items()
            if "_stderr," in k
        }
        for task, metrics in results.get("results", results).items()
    }


def _metric_name(key: str) -> str:
    metric, _, filter_name = key.partition(",")
    return metric if filter_name == "none" else key
