"""The command line: every serve option documented, HEADWATER_* variables mirror them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from frontend.config import FrontendConfig
from headwater.cli import build_parser, env_name
from headwater.cli.serve import frontend_config_from_args as config_from_args
from headwater.machine import usable_cpus

SERVE_OPTIONS = [
    "--host",
    "--port",
    "--model-name",
    "--tokenizer",
    "--context-length",
    "--tokenizer-backend",
    "--tokenize-mode",
    "--tokenizer-threads",
    "--engine",
    "--mode",
    "--speedup-ratio",
    "--log-level",
    "--max-body-bytes",
    "--workers",
    "--discovery",
    "--router",
    "--ack-timeout",
    "--instrument",
    "--no-instrument",
    "--stall-threshold-ms",
    "--max-inflight",
    "--drain-timeout",
    "--graceful-timeout",
    "--write-timeout",
    "--ssl-certfile",
    "--ssl-keyfile",
    "--max-header-bytes",
    "--header-timeout",
    "--read-timeout",
    "--max-connections-per-client",
]


def test_serve_help_documents_every_option_and_its_variable() -> None:
    text = build_parser("serve").format_help()
    for option in SERVE_OPTIONS:
        assert option in text, option
        if not option.startswith("--no-"):  # a pair's variable is its positive name's
            assert env_name(option) in "".join(text.split()), option
    # The repro-only modes say so.
    assert "REPRODUCE" in text


def test_defaults_match_the_config_object() -> None:
    config = config_from_args(build_parser("serve").parse_args([]))
    assert config == FrontendConfig(tokenizer_threads=usable_cpus())
    assert config.host == "127.0.0.1"
    assert config.port == 8000
    assert config.model_name == "deepseek-v4"
    assert config.tokenizer_backend == "fastokens"
    assert config.tokenize_mode == "thread"
    assert config.mode == "disagg"


def test_environment_variables_mirror_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADWATER_TOKENIZER_THREADS", "3")
    monkeypatch.setenv("HEADWATER_TOKENIZE_MODE", "inline")
    monkeypatch.setenv("HEADWATER_INSTRUMENT", "false")
    monkeypatch.setenv("HEADWATER_SPEEDUP_RATIO", "250")
    config = config_from_args(build_parser("serve").parse_args([]))
    assert config.tokenizer_threads == 3
    assert config.tokenize_mode == "inline"
    assert config.instrument is False
    assert config.engine_config.speedup_ratio == 250.0
    monkeypatch.setenv("HEADWATER_MAX_INFLIGHT", "0")
    monkeypatch.setenv("HEADWATER_DRAIN_TIMEOUT", "2.5")
    config = config_from_args(build_parser("serve").parse_args([]))
    assert (config.max_inflight, config.drain_timeout) == (0, 2.5)
    # The command line wins over the environment.
    args = build_parser("serve").parse_args(["--tokenizer-threads", "5"])
    assert config_from_args(args).tokenizer_threads == 5


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("HEADWATER_TOKENIZER_THREADS", "zero"),
        ("HEADWATER_TOKENIZE_MODE", "sideways"),
        ("HEADWATER_TOKENIZER_THREADS", "0"),
        ("HEADWATER_MAX_INFLIGHT", "-1"),
        ("HEADWATER_DRAIN_TIMEOUT", "-1"),
        ("HEADWATER_DRAIN_TIMEOUT", "nan"),
    ],
)
def test_bad_environment_values_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exc:
        build_parser("serve")
    assert exc.value.code == 2
    assert var in capsys.readouterr().err


def test_bad_flags_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["--tokenizer-backend", "sentencepiece"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_headwater_is_the_headwater_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "headwater", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith("usage: headwater serve")


def test_api_keys_come_from_flags_and_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HEADWATER_API_KEYS", "env-1,env-2")
    keys_file = tmp_path / "keys"
    keys_file.write_text("file-1\n")
    args = build_parser("serve").parse_args(
        ["--api-key", "flag-1", "--api-key", "flag-2", "--api-keys-file", str(keys_file)]
    )
    config = config_from_args(args)
    # The file's keys are read by the frontend, which follows the file (rotation).
    assert config.api_keys == ("flag-1", "flag-2", "env-1", "env-2")
    assert config.api_keys_file == str(keys_file)
    keys_file.write_text("bad key\n")  # but a bad file is a bad option at start
    with pytest.raises(ValueError, match="API key"):
        config_from_args(args)
    assert "flag-1" not in repr(config)  # keys stay out of logs


def test_tls_files_are_checked_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from headwater.cli import main

    missing = str(tmp_path / "missing.pem")
    assert main(["serve", "--ssl-certfile", missing]) == 2
    assert "both --ssl-certfile and --ssl-keyfile" in capsys.readouterr().err
    assert main(["serve", "--ssl-certfile", missing, "--ssl-keyfile", missing]) == 2
    assert missing in capsys.readouterr().err
    plane = ["--plane-tls-certfile", missing, "--plane-tls-keyfile", missing]
    assert main(["serve", *plane]) == 2
    assert "all three" in capsys.readouterr().err
    assert main(["serve", *plane, "--plane-tls-ca-file", missing]) == 2
    assert missing in capsys.readouterr().err


def test_serve_takes_the_plane_secret_from_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--plane-secret-file`` (a Kubernetes Secret mounted as a file): read and checked at
    start, then in the variable the plane clients and a group's processes read."""
    from headwater.cli.serve import load_plane_secret
    from headwater.wire.handshake import SECRET_ENV, load_secret

    # Set, then deleted: monkeypatch records the variable as unset, so it unsets it again
    # afterwards although load_plane_secret sets it behind monkeypatch's back (a bare
    # delenv of an unset variable records nothing, and the secret leaked into later tests).
    monkeypatch.setenv(SECRET_ENV, "")
    monkeypatch.delenv(SECRET_ENV)
    secrets = tmp_path / "plane-secret"
    secrets.write_text("Zq8wLr3vNp6tYk2mXc9bHf4jDs7gWa5e\nPe4kTm8wQz3nRx6vLb9cJh2fYs5dGa7u\n")
    args = build_parser("serve").parse_args(["--plane-secret-file", str(secrets)])
    load_plane_secret(args.plane_secret_file)
    secret = load_secret()  # from the variable now
    assert secret is not None
    assert load_secret(str(secrets)) == secret  # the new one and the one still accepted

    monkeypatch.delenv(SECRET_ENV)
    secrets.write_text("hunter2\n")
    with pytest.raises(ValueError, match="plane secret"):
        load_plane_secret(str(secrets))
    assert load_secret() is None  # a refused secret is not passed on
