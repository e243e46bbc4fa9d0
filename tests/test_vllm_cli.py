"""The vllm engine on every command line, without vLLM: options, what the frontend
takes from the model directory, the vocabulary check, and launch's plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from frontend.config import FrontendConfig
from frontend.preprocess.tokenizer import TokenizerLoadError, default_tokenizer_dir
from frontend.server import Frontend
from headwater.cli import build_parser
from headwater.cli.launch import plan_from_args
from headwater.cli.serve import frontend_config_from_args
from headwater.cli.worker import worker_config_from_args
from workers.engines.vllm import VllmConfig

DEEPSEEK_VOCAB = 129280


def model_dir(tmp_path: Path, vocab: int = DEEPSEEK_VOCAB) -> Path:
    """A model directory as scripts/build_tiny_model.py writes one (weights left out)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default_tokenizer_dir() / name, tmp_path / name)
    return tmp_path


def test_serve_takes_tokenizer_context_and_vocabulary_from_the_model(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    args = build_parser("serve").parse_args(
        ["--engine", "vllm", "--model", str(model), "--max-model-len", "4096", "--mode", "agg"]
    )
    config = frontend_config_from_args(args)
    assert config.tokenizer == str(model)
    assert config.context_length == 4096
    assert config.model_vocab_size == DEEPSEEK_VOCAB
    assert isinstance(config.engine_config, VllmConfig)
    assert config.engine_config.model == str(model)
    # What is given wins; remote workers get nothing from the in-process engine.
    args = build_parser("serve").parse_args(
        [
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--context-length",
            "100",
            "--tokenizer",
            "elsewhere",
        ]
    )
    config = frontend_config_from_args(args)
    assert (config.tokenizer, config.context_length) == ("elsewhere", 100)
    args = build_parser("serve").parse_args(["--workers", "tcp://127.0.0.1:1?role=agg"])
    config = frontend_config_from_args(args)
    assert (config.tokenizer, config.context_length, config.model_vocab_size) == (
        None,
        FrontendConfig().context_length,
        0,
    )


def test_processes_auto_is_one_frontend_with_in_process_vllm_workers(tmp_path: Path) -> None:
    from headwater.machine import usable_cpus

    cores = usable_cpus()  # 2 here; on one core both rules give 1
    model = str(model_dir(tmp_path))

    def processes(*argv: str) -> int:
        return frontend_config_from_args(build_parser("serve").parse_args(list(argv))).processes

    # Each process of a group would start vLLM children of its own.
    assert processes("--engine", "vllm", "--model", model) == 1
    assert processes("--engine", "vllm", "--model", model, "--processes", "auto") == 1
    assert processes("--engine", "vllm", "--model", model, "--processes", "3") == 3
    # The mocker, or workers elsewhere: one frontend process per usable CPU.
    assert processes() == cores
    assert processes("--processes", "auto") == cores
    assert processes("--engine", "vllm", "--workers", "tcp://127.0.0.1:1?role=agg") == cores


@pytest.mark.slow
def test_a_tokenizer_with_more_ids_than_the_model_is_refused_at_start(tmp_path: Path) -> None:
    model = model_dir(tmp_path, vocab=32000)
    config = FrontendConfig(tokenizer=str(model), model_vocab_size=32000, port=0)
    with pytest.raises(TokenizerLoadError, match="129280 ids but the model's vocabulary is 32000"):
        Frontend(config)


def test_worker_options_build_a_vllm_config(tmp_path: Path) -> None:
    args = build_parser("worker").parse_args(
        [
            "--engine",
            "vllm",
            "--role",
            "prefill",
            "--model",
            str(tmp_path),
            "--vllm-args=--max-num-seqs 8",
            "--enforce-eager",
            "--kv-lease-duration",
            "45",
        ]
    )
    config = worker_config_from_args(args)
    engine = config.engine_config
    assert isinstance(engine, VllmConfig)
    assert (engine.model, engine.vllm_args, engine.enforce_eager) == (
        str(tmp_path),
        "--max-num-seqs 8",
        True,
    )
    assert engine.kv_lease_duration == 45


def test_launch_passes_the_engine_options_and_the_models_tokenizer(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    args = build_parser("launch").parse_args(
        [
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--discovery",
            "static",
            "--enforce-eager",
        ]
    )
    plan = plan_from_args(args)
    assert plan.engine == "vllm"
    assert "--model" in plan.engine_args
    assert "--enforce-eager" in plan.engine_args
    serve = list(plan.serve_args)
    assert serve[serve.index("--tokenizer") + 1] == str(model)
    assert serve[serve.index("--model-vocab-size") + 1] == str(DEEPSEEK_VOCAB)
    assert serve[serve.index("--context-length") + 1] == "8192"
    assert plan.start_within >= VllmConfig().vllm_start_timeout  # a vLLM start is slow
