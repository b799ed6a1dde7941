"""The `swiftlm` command: `swiftlm <subcommand> [config.yaml] [--flag value ...]`."""

import difflib
import importlib
import logging
import os
import sys
import warnings

from swiftlm.distributed.failures import failure_dir, report_error, write_failure
from swiftlm.distributed.launch import launch, wants_launch
from swiftlm.errors import Preempted, SwiftLMError
from swiftlm.plugins import load_plugins
from swiftlm.plugins.loading import plugin_files

# The commands that start their own processes under torchrun when their flags ask for more
# than one (--nproc_per_node, --nnodes ...); the others run in this process.
LAUNCHING_COMMANDS = frozenset({"sft", "pt", "rlhf"})
# subcommand -> (config class path, module with run(cfg), one-line description). A training
# command (TrainConfig) is a method of `swiftlm.methods.METHODS`, run as run(cfg, name).
COMMANDS = {
    "sft": ("TrainConfig", "swiftlm.train.run", "Supervised fine-tuning (full, LoRA, DoRA)."),
    "pt": ("TrainConfig", "swiftlm.train.run", "Continued pre-training on plain text."),
    "rlhf": (
        "RLHFConfig",
        "swiftlm.train.run",
        "Preference alignment on chosen/rejected pairs: --rlhf_type dpo.",
    ),
    "infer": (
        "InferConfig",
        "swiftlm.infer.run",
        "Chat with a model, or answer a dataset in batch.",
    ),
    "eval": (
        "EvalConfig",
        "swiftlm.evaluation.run",
        "Evaluate a model, run or served endpoint on tasks (swiftlm/quick, files, lm-eval), "
        "with confidence intervals; --compare A B: the paired difference.",
    ),
    "export": (
        "ExportConfig",
        "swiftlm.export.run",
        "Write a model for serving elsewhere, checked: --merge_lora, --to_gguf/--to_ollama, "
        "--quant_method, --to_onnx.",
    ),
    "deploy": (
        "DeployConfig",
        "swiftlm.serve.run",
        "Serve a model and its adapters over an OpenAI-compatible HTTP API.",
    ),
    "rollout": (
        "RolloutConfig",
        "swiftlm.serve.rollout",
        "Serve a model on vLLM to GRPO/GKD trainers (--vllm_mode server): they push their "
        "weights over a collective before every generation.",
    ),
    "plan": (
        "PlanConfig",
        "swiftlm.plan.run",
        "Memory per device and step time of each parallel strategy for a job on given "
        "devices (e.g. --devices 8xH100), from the model's config; recommends the fastest that fits.",
    ),
    "report": (
        "ReportConfig",
        "swiftlm.report.run",
        "Draw run directories as one offline report.html (several overlay); --serve: live.",
    ),
    "web": (
        "WebConfig",
        "swiftlm.web.run",
        "Browser UI: configure, start, stop, resume and watch runs; chat, export, evaluate.",
    ),
}


def usage() -> str:
    lines = ["usage: swiftlm <command> [config.yaml] [--flag value ...]", "", "commands:"]
    lines += [f"  {name:<8} {desc}" for name, (_, _, desc) in COMMANDS.items()]
    lines += ["", "`swiftlm <command> --help` lists the flags of a command."]
    return "\n".join(lines)


def nearest_command(name: str) -> str:
    """The hint for a mistyped command (`; did you mean 'sft'?`), or an empty string."""
    match = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def with_default_recipe(name: str, argv: list[str]) -> list[str]:
    """`swiftlm sft` with neither a config file, --model nor --dataset runs the built-in job."""
    if name != "sft" or (argv and argv[0].endswith((".yaml", ".yml"))):
        return argv
    flags = {a.lstrip("-").split("=")[0].replace("-", "_") for a in argv if a.startswith("-")}
    if flags & {"model", "dataset", "help", "h"}:
        return argv
    from importlib.resources import files

    recipe = str(files("swiftlm") / "assets" / "default_sft.yaml")
    print(f"No --model or --dataset: running the built-in default job ({recipe})", flush=True)
    return [recipe, *argv]


def with_run_dirs(name: str, argv: list[str]) -> list[str]:
    """`swiftlm report A B --flag` -> `--run_dirs A B --flag`: run directories are positional."""
    if name != "report":
        return argv
    head = argv[:1] if argv and argv[0].endswith((".yaml", ".yml")) else []
    rest = argv[len(head) :]
    count = next((i for i, arg in enumerate(rest) if arg.startswith("-")), len(rest))
    if count == 0:
        return argv
    return [*head, "--run_dirs", *rest[:count], *rest[count:]]


def quiet_libraries() -> None:
    """Keep the terminal for swiftlm's own output; library warnings stay available at DEBUG."""
    # Set explicitly, which also silences the library's fork warning. swiftlm tokenizes before
    # anything forks (torchrun starts its workers first), so batch encoding may use all cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\.")
    hf_logging.disable_progress_bar()
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    # transformers imports torchao and peft imports bitsandbytes whenever they are installed,
    # on every command; their import-time warnings concern kernels a user cannot act on.
    from swiftlm.models.quant import silence_quantization_noise

    silence_quantization_noise()


def record_preemption(exc: Preempted) -> None:
    """In a worker of swiftlm's launcher, tell it the workers stopped for preemption after
    saving (it then exits with the same status rather than 128 + the signal)."""
    folder = failure_dir()
    if folder is not None:
        write_failure(folder, str(exc), exc.exit_code, printed=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from swiftlm import __version__

        print(f"swiftlm {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"swiftlm: unknown command '{name}'{nearest_command(name)}\n\n{usage()}",
            file=sys.stderr,
        )
        return 2
    config_name, module_name, description = COMMANDS[name]
    try:
        import swiftlm.config as config_module
        from swiftlm.config.outputs import check_outputs
        from swiftlm.config.parse import parse_config
        from swiftlm.config.paths import check_input_kinds

        argv = with_run_dirs(name, with_default_recipe(name, rest))
        # Before parsing: plugins may add names the flags are checked against.
        load_plugins(plugin_files(argv))
        config_cls = getattr(config_module, config_name)
        unused = config_module.UNUSED_FLAGS[name]
        cfg = parse_config(config_cls, argv, f"swiftlm {name}", description, unused)
        # Before any work, and before torchrun starts workers: every path is the kind its
        # flag needs, and no output writes over an input or an existing file.
        check_input_kinds(cfg)
        check_outputs(cfg)
        # Before anything imports torchao or bitsandbytes, in the process that only launches
        # the workers too: their import-time warnings stay off the user's terminal.
        quiet_libraries()
        if name in LAUNCHING_COMMANDS and wants_launch(cfg.dist):
            from swiftlm.plan.auto import resolve_auto_strategy  # --strategy auto: plan once

            argv = resolve_auto_strategy(cfg, name, argv)
            return launch(cfg.dist, name, argv, cfg.output.output_dir)
        run = importlib.import_module(module_name).run
        if config_name == "TrainConfig":
            run(cfg, name)
        elif config_name == "RLHFConfig":
            run(cfg, cfg.rlhf.rlhf_type)
        else:
            run(cfg)
    except Preempted as exc:  # rank 0's loop has said where the checkpoint is
        record_preemption(exc)
        return exc.exit_code
    except SwiftLMError as exc:
        report_error(name, exc)  # a torchrun worker leaves it to the launcher, to print once
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"\nswiftlm {name}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
