"""Options declared once (headwater/config_fields.py): a config field's declaration makes
its command-line option, its HEADWATER_* variable, its help and its docs/cli.md row, and
the parsed value comes back into the config. These tests hold the mechanism to that:
an option added as a field needs nothing else, and no field is forgotten."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.choices import Layout, Policy
from frontend.config import FrontendConfig
from headwater.cli import build_parser, env_name
from headwater.cli.options import (
    add_config_options,
    apply_env_defaults,
    config_argv,
    declared_flags,
)
from headwater.cli.options import config_from_args as generic_config_from_args
from headwater.cli.serve import frontend_config_from_args
from headwater.config_fields import (
    dest_of,
    flags_of,
    option,
    option_fields,
    positive_int,
    sub_config_fields,
)

#: FrontendConfig's fields that are neither options nor configs holding options: the
#: engine's config (its options are the engine's), and values the command line builds
#: from several options (keys from --api-key and a variable, etcd's credentials).
NOT_OPTIONS = {"api_keys", "engine_config", "etcd_credentials"}


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Toy:
    """A config with one option of each kind, declared the one way."""

    size: int = option(3, group="toy", type=positive_int, help="how big")
    colour: Colour = option(Colour.RED, group="toy", help="which colour")
    loud: bool = option(False, group="toy", help="shout")
    name: str | None = option(None, group="toy", from_model=True, help="a name")
    tags: tuple[str, ...] = option((), group="toy", flags=("--tag",), repeat=True, help="tags")
    internal: int = 0  # not an option: no help


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_options(parser, Toy)
    return parser


def test_a_field_declared_as_an_option_needs_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = _parser()
    assert [f.name for f in option_fields(Toy)] == ["size", "colour", "loud", "name", "tags"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert groups["toy"] == ["size", "colour", "loud", "name", "tag"]  # dest: the flag's
    # Defaults: the fields'; the model decides the from_model one.
    assert generic_config_from_args(Toy, parser.parse_args([])) == Toy()
    got = generic_config_from_args(Toy, parser.parse_args([]), {"name": "from-model"})
    assert got.name == "from-model"
    args = parser.parse_args(
        ["--size", "7", "--colour", "blue", "--loud", "--name", "n", "--tag", "a", "--tag", "b"]
    )
    toy = generic_config_from_args(Toy, args, {"name": "from-model"})
    assert toy == Toy(size=7, colour=Colour.BLUE, loud=True, name="n", tags=("a", "b"))
    # A supervisor passes a config on as a command line that gives it back.
    assert generic_config_from_args(Toy, parser.parse_args(config_argv(toy))) == toy
    # Bad values are the parser's errors (an enum's members are its choices).
    for argv in (["--size", "0"], ["--colour", "green"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    # Each has a variable, through the option's own type.
    monkeypatch.setenv("HEADWATER_SIZE", "9")
    monkeypatch.setenv("HEADWATER_LOUD", "yes")
    parser = _parser()
    apply_env_defaults(parser)
    assert generic_config_from_args(Toy, parser.parse_args([])) == Toy(size=9, loud=True)


def test_every_frontend_field_is_an_option_or_a_named_sub_config() -> None:
    names = {f.name for f in dataclasses.fields(FrontendConfig)}
    options = {f.name for f in option_fields(FrontendConfig)}
    held = {f.name for f in sub_config_fields(FrontendConfig)}
    assert held == {"kv", "health", "busy", "limits", "responses_store"}
    assert names - options - held == NOT_OPTIONS
    for f in sub_config_fields(FrontendConfig):  # each holds options, and only options
        assert option_fields(f.metadata["sub_config"]), f.name


def test_every_serve_option_has_help_a_variable_a_default_and_a_reference_row() -> None:
    parser = build_parser("serve")
    by_dest = {a.dest: a for a in parser._actions}
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    configs = [(FrontendConfig(), FrontendConfig)] + [
        (getattr(FrontendConfig(), f.name), f.metadata["sub_config"])
        for f in sub_config_fields(FrontendConfig)
    ]
    for defaults, f in ((d, f) for d, kind in configs for f in option_fields(kind)):
        action = by_dest[dest_of(f)]
        flag = flags_of(f)[0]
        assert flag in action.option_strings
        if f.metadata.get("hidden"):
            assert action.help == argparse.SUPPRESS
            continue
        assert action.help, flag
        if not f.metadata.get("repeat"):  # a repeatable option has no variable
            assert env_name(flag) in action.help, flag
        assert f"`{flag}`" in page, flag
        if not (f.metadata.get("from_model") or f.metadata.get("repeat")):
            # What --help shows is what a FrontendConfig holds by default (a count of
            # CPUs is this machine's in both).
            assert action.default == getattr(defaults, f.name), flag


def test_enum_fields_take_their_strings_and_refuse_others() -> None:
    config = FrontendConfig(router="kv", mode="agg")  # type: ignore[arg-type]  # strings: the point
    assert config.router is Policy.KV
    assert config.mode is Layout.AGG
    assert config.router == "kv"  # type: ignore[comparison-overlap]  # a StrEnum is its string
    with pytest.raises(ValueError, match="router must be one of round-robin, random"):
        FrontendConfig(router="nearest")  # type: ignore[arg-type]
    args = build_parser("serve").parse_args(["--router", "p2c", "--kv-events", "off"])
    config = frontend_config_from_args(args)
    assert (config.router, config.kv.events) == (Policy.P2C, "off")
    assert not config.kv.uses_events


def test_the_engine_decides_what_the_command_line_leaves_unset(tmp_path: Path) -> None:
    """--kv-block-size, --model-vocab-size, --context-length come from the in-process
    engine's model unless given: a vLLM engine's block size reaches the KV router."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4321}))
    argv = ["--engine", "vllm", "--model", str(tmp_path), "--vllm-block-size", "16"]
    config = frontend_config_from_args(build_parser("serve").parse_args(argv))
    assert (config.kv.block_size, config.model_vocab_size) == (16, 4321)
    given = [*argv, "--kv-block-size", "32", "--model-vocab-size", "5000"]
    config = frontend_config_from_args(build_parser("serve").parse_args(given))
    assert (config.kv.block_size, config.model_vocab_size) == (32, 5000)
    # With remote workers nothing is decided by an in-process engine: the field's default.
    args = build_parser("serve").parse_args(["--workers", "tcp://127.0.0.1:1?role=agg"])
    assert frontend_config_from_args(args).kv.block_size == FrontendConfig().kv.block_size
    args = build_parser("serve").parse_args(["--kv-block-size", "32"])
    assert frontend_config_from_args(args).kv.block_size == 32


@pytest.mark.parametrize("command", ["serve", "worker", "launch"])
def test_another_engines_option_is_refused_not_ignored(command: str) -> None:
    from headwater.cli.options import engine_config_from_args

    def config(*argv: str) -> object:
        args = build_parser(command).parse_args(list(argv))
        args.argv = argv
        return engine_config_from_args(args)

    with pytest.raises(ValueError, match="--model is an option of the vllm engine, not of mocker"):
        config("--model", "/models/x")
    with pytest.raises(ValueError, match="--script is an option of the scripted engine"):
        config("--engine", "vllm", "--script=answers.json")
    # The chosen engine's own options, and a name several engines share, are taken.
    assert config("--engine", "vllm", "--model", "/models/x").model == "/models/x"  # type: ignore[attr-defined]
    assert config("--max-num-seqs", "8").max_num_seqs == 8  # type: ignore[attr-defined]


def test_a_refused_option_is_one_line_and_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "headwater", "serve", "--vllm-url", "http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "headwater serve: --vllm-url is an option of the vllm engine, not of mocker "
        "(--engine mocker)"
    ]


def test_one_name_and_one_default_per_meaning() -> None:
    """The pairs that confused: a vocabulary size under two names, a vLLM's restarts
    beside a supervisor's restart budget, a drain of 10 s in launch and 30 s in serve."""
    from headwater.cluster.launch import ClusterPlan
    from workers.lifecycle import WorkerConfig

    serve, worker, launch = (build_parser(c) for c in ("serve", "worker", "launch"))
    everywhere = [{s for a in p._actions for s in a.option_strings} for p in (serve, worker)]
    for flags in everywhere:
        assert "--model-vocab-size" in flags
        assert "--vocab-size" not in flags
        assert "--restart-limit" not in flags
    # serve --model-vocab-size reaches an in-process vLLM's config too.
    args = serve.parse_args(["--engine", "vllm", "--model-vocab-size", "1000"])
    config = frontend_config_from_args(args)
    assert config.model_vocab_size == config.engine_config.vocab_size == 1000
    # One drain for every process.
    drains = {
        serve.get_default("drain_timeout"),
        worker.get_default("drain_timeout"),
        launch.get_default("drain_timeout"),
        WorkerConfig.__dataclass_fields__["drain_timeout"].default,
        ClusterPlan.__dataclass_fields__["drain_timeout"].default,
    }
    assert drains == {30.0}


def test_the_workers_options_are_its_configs_fields_too() -> None:
    """headwater worker: WorkerConfig's fields and its plane listener's, declared once;
    the rest are what the command line assembles (the engine's config, the secret and
    TLS from files, etcd's credentials) and the plane client's internals."""
    from headwater.cli.worker import worker_config_from_args
    from workers.lifecycle import WorkerConfig

    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    options = {f.name for f in option_fields(WorkerConfig)}
    held = {f.name for f in sub_config_fields(WorkerConfig)}
    assert held == {"server"}
    assert names - options - held == {"engine_config", "secret", "tls", "etcd", "plane"}
    parser = build_parser("worker")
    argv = [
        "--role",
        "decode",
        "--kv-peers",
        "tcp://127.0.0.1:9001, tcp://127.0.0.1:9002",
        "--peer-timeout",
        "20",
        "--max-connections",
        "8",
        "--lease-ttl",
        "4",
    ]
    config = worker_config_from_args(parser.parse_args(argv))
    assert config.role == "decode"
    assert config.kv_peers == ("tcp://127.0.0.1:9001", "tcp://127.0.0.1:9002")
    assert (config.server.heartbeat_timeout, config.server.max_connections) == (20.0, 8)
    assert config.lease_ttl == 4
    assert config.worker_id.startswith("decode-")
    defaults = worker_config_from_args(parser.parse_args([]))
    assert defaults.server == WorkerConfig(worker_id="x").server
    assert defaults.kv_peers == ()


def test_the_launchers_options_are_its_configs_fields_too() -> None:
    """headwater launch: LaunchConfig's fields (its restart policy a sub-config, shared
    with serve's supervisor) are its options, and the plan is made from the config."""
    from headwater.cli.launch import LaunchConfig, plan_from_args
    from headwater.cluster.supervisor import RestartPolicy
    from workers.engines import registry

    parser = build_parser("launch")
    engines = set().union(*(declared_flags(registry.config_type(n)) for n in registry.names()))
    launch_flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    assert launch_flags - engines - {"-h"} == declared_flags(LaunchConfig)
    assert {f.name for f in dataclasses.fields(LaunchConfig)} == (
        {f.name for f in option_fields(LaunchConfig)}
        | {f.name for f in sub_config_fields(LaunchConfig)}
    )
    argv = ["--agg", "2", "--port", "0", "--discovery", "static", "--restart-budget", "0"]
    plan = plan_from_args(parser.parse_args([*argv, "--worker-metrics", "--", "--router", "p2c"]))
    assert (plan.agg, plan.prefill, plan.decode, plan.port) == (2, 0, 0, 0)
    assert plan.restart == RestartPolicy(budget=0)
    assert plan.worker_metrics is True
    assert plan.serve_args[:2] == ("--router", "p2c")
    defaults = plan_from_args(parser.parse_args(["--port", "0", "--discovery", "static"]))
    assert (defaults.prefill, defaults.decode, defaults.restart) == (1, 1, RestartPolicy())
    with pytest.raises(SystemExit):
        parser.parse_args(["--restart-budget", "-1"])  # the policy's own value type
