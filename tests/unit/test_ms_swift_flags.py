"""ms-swift command lines and YAML files under swiftlm: renamed flags, flags mapped by value
(each with a note), and unsupported flags as errors that say why and what to use."""

from pathlib import Path

import pytest

from script_loader import load_script
from swiftlm.cli.main import main
from swiftlm.config import UNUSED_FLAGS, TrainConfig, parse_config
from swiftlm.config.ms_swift import RENAMED, UNSUPPORTED, VALUE_RULES
from swiftlm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

# ms-swift's README quick start (Qwen2.5-7B self-cognition LoRA), flag for flag.
QUICK_START = """--model Qwen/Qwen2.5-7B-Instruct --train_type lora --dataset
AI-ModelScope/alpaca-gpt4-data-zh#500 swift/self-cognition#500 --torch_dtype bfloat16
--num_train_epochs 1 --per_device_train_batch_size 1 --per_device_eval_batch_size 1
--learning_rate 1e-4 --lora_rank 8 --lora_alpha 32 --target_modules all-linear
--gradient_accumulation_steps 16 --eval_steps 50 --save_steps 50 --save_total_limit 2
--logging_steps 5 --max_length 2048 --output_dir output --warmup_ratio 0.05
--dataloader_num_workers 4 --model_author swift --model_name swift-robot"""
QUICK_START = QUICK_START.split()


def table_script():
    return load_script("ms_swift_table")


def parse(argv, config_cls=TrainConfig, command="sft"):
    return parse_config(config_cls, argv, f"swiftlm {command}", unused=UNUSED_FLAGS[command])


def test_the_tables_stay_true_and_the_page_is_current():
    script = table_script()
    own = script.swiftlm_flags()
    assert not set(UNSUPPORTED) & set(own), "a supported flag is listed as unsupported"
    assert not set(RENAMED) & set(own), "a renamed ms-swift flag is also a swiftlm flag"
    # Their swiftlm values pass unchanged; the rules translate ms-swift's other spellings.
    assert set(VALUE_RULES) & set(own) == {"attn_impl", "infer_backend"}
    assert set(RENAMED.values()) <= set(own)
    assert script.main(["--check"]) == 0, "run: python scripts/ms_swift_table.py"


def test_the_ms_swift_quick_start_parses_as_written(capsys):
    cfg = parse(QUICK_START)
    assert cfg.tuner.train_type == "lora" and cfg.tuner.target_modules == ["all-linear"]
    assert cfg.data.dataset[1] == "swift/self-cognition#500"  # built in, as swiftlm/self-cognition
    assert (cfg.train.gradient_accumulation_steps, cfg.output.save_total_limit) == (16, 2)
    assert "--dataloader_num_workers 4: not needed by swiftlm" in capsys.readouterr().err


def test_value_flags_become_swiftlm_flags_with_a_note(capsys):
    cfg = parse(
        ["--model", "m", "--dataset", "d.jsonl", "--tuner_type", "lora", "--use_dora", "true"]
        + ["--bf16", "true", "--loss_scale", "last_round", "--attn_impl", "flash_attn"]
    )
    assert cfg.tuner.train_type == "dora"
    assert (cfg.model.torch_dtype, cfg.data.loss_scope, cfg.model.attn_impl) == (
        "bfloat16",
        "last_turn",
        "sdpa",
    )
    notes = capsys.readouterr().err.splitlines()
    assert notes == [
        "swiftlm sft: ms-swift flag --bf16 true is --torch_dtype bfloat16",
        "swiftlm sft: ms-swift flag --loss_scale last_round is --loss_scope last_turn",
        "swiftlm sft: ms-swift flag --attn_impl flash_attn is --attn_impl sdpa (PyTorch's "
        "scaled-dot-product attention runs FlashAttention kernels on CUDA; packing works with "
        "it, no flash-attn package)",
        "swiftlm sft: ms-swift flag --use_dora true is --train_type dora",
    ]


def test_use_dora_alone_and_false():
    assert parse(["--model", "m", "--dataset", "d", "--use_dora=true"]).tuner.train_type == "dora"
    assert parse(["--model", "m", "--dataset", "d", "--use_dora", "false"]).tuner.train_type == (
        "lora"
    )


def test_a_yaml_file_with_ms_swift_keys(tmp_path, capsys):
    recipe = tmp_path / "ms_swift.yaml"
    recipe.write_text(
        "model: m\ndataset: [d.jsonl]\nsft_type: lora\nuse_dora: true\nbf16: true\n"
        "loss_scale: default\nlazy_tokenize: true\n"
    )
    cfg = parse([str(recipe)])
    assert (cfg.tuner.train_type, cfg.model.torch_dtype, cfg.data.loss_scope) == (
        "dora",
        "bfloat16",
        "assistant",
    )
    assert "--lazy_tokenize true: not needed by swiftlm" in capsys.readouterr().err


def test_notes_print_on_rank_zero_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    parse(["--model", "m", "--dataset", "d", "--bf16", "true"])
    assert capsys.readouterr().err == ""


@pytest.mark.bad_input(
    input="an ms-swift flag swiftlm does not support (`--sleep_level 1`, `--model_type qwen2`)",
    outcome="Exit 2: `--sleep_level is an ms-swift flag that swiftlm does not support:` the reason "
    "and what to use instead",
)
@pytest.mark.parametrize(
    ("flag", "reason"),
    [
        ("--sleep_level", "vLLM's memory is not released"),
        ("--model_type", "reads the architecture from the model's config.json"),
        ("--warmup_steps", "--warmup_ratio"),
        ("--deepspeed_autotp_size", "--tensor_parallel_size"),
    ],
)
def test_an_unsupported_ms_swift_flag_is_an_error_with_the_way_out(capsys, flag, reason):
    assert main(["sft", "--model", "m", "--dataset", "d.jsonl", flag, "2"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} is an ms-swift flag that swiftlm does not support" in err and reason in err


@pytest.mark.bad_input(
    input="an ms-swift value swiftlm cannot honour (`--use_dora true --train_type full`, "
    "`--loss_scale react`, `--bf16 false`, `--infer_backend lmdeploy`, an unsupported YAML key)",
    outcome="Exit 2 naming the flag, value and what to give instead",
)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--use_dora", "true", "--train_type", "full"], "--use_dora true needs LoRA"),
        (["--loss_scale", "react"], "--loss_scope assistant|last_turn|all"),
        (["--bf16", "false"], "give --torch_dtype float32"),
        (["--dataset_shuffle", "false"], "seeded by --data_seed"),
        (["--use_hf", "false"], "give --model DIR"),
    ],
)
def test_an_ms_swift_value_swiftlm_cannot_honour(argv, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        parse(["--model", "m", "--dataset", "d", *argv])


def test_an_unsupported_yaml_key_names_the_file(tmp_path):
    recipe = tmp_path / "ms.yaml"
    recipe.write_text("model: m\ndataset: [d.jsonl]\nneftune_noise_alpha: 5\n")
    with pytest.raises(ConfigError, match=r"ms\.yaml: --neftune_noise_alpha is an ms-swift flag"):
        parse([str(recipe)])


def test_ms_swift_s_grpo_vllm_flags_are_infer_backend_vllm(capsys):
    from swiftlm.config import RLHFConfig

    argv = ["--rlhf_type", "grpo", "--model", "m", "--dataset", "d", "--use_vllm", "true"]
    cfg = parse([*argv, "--vllm_mode", "colocate"], RLHFConfig, "rlhf")
    assert cfg.grpo.infer_backend == "vllm" and cfg.grpo.vllm_mode == "colocate"
    assert "--use_vllm true is --infer_backend vllm" in capsys.readouterr().err
    server = [
        "--vllm_mode",
        "server",
        "--vllm_server_host",
        "10.0.0.2",
        "--vllm_server_port",
        "8001",
    ]
    cfg = parse([*argv, *server], RLHFConfig, "rlhf")
    assert (cfg.grpo.vllm_mode, cfg.grpo.vllm_server_host) == ("server", "10.0.0.2")
    assert cfg.grpo.vllm_server_port == 8001
    with pytest.raises(SystemExit):  # argparse names the choices
        parse([*argv, "--vllm_mode", "remote"], RLHFConfig, "rlhf")


def test_infer_backend_is_swiftlm_s_own_flag_with_ms_swift_s_values(capsys):
    from swiftlm.config import InferConfig

    for value in ("pt", "vllm"):
        cfg = parse(["--model", "m", "--infer_backend", value], InferConfig, "infer")
        assert cfg.infer.infer_backend == value
    assert capsys.readouterr().err == ""
    cfg = parse(["--model", "m", "--infer_backend", "transformers"], InferConfig, "infer")
    assert cfg.infer.infer_backend == "pt"
    assert "--infer_backend transformers is --infer_backend pt" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--infer_backend lmdeploy is not supported: choose pt"):
        parse(["--model", "m", "--infer_backend", "lmdeploy"], InferConfig, "infer")
