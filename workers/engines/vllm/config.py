"""Configuration of the vLLM engine: which vLLM, started how, watched how often.

A worker either starts a vLLM server of its own (``--model PATH``: a child process on
a free loopback port, supervised and restarted) or attaches to one that runs
elsewhere (``--vllm-url URL``, e.g. on a GPU node). Every field with a ``help`` is a
command-line option of ``headwater serve``, ``worker`` and ``launch``.
"""

from __future__ import annotations

import enum
import json
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from workers.engines.config import EngineConfig

#: Why an engine without a vocabulary size is refused (here at start, and by the engine).
NO_VOCABULARY = (
    "the vllm engine needs the model's vocabulary size to refuse token ids vLLM would "
    "crash on: --model with a local model directory (its config.json), or --model-vocab-size"
)
#: Seconds the start-up check gives an attached server's address to accept a connection.
PROBE_TIMEOUT = 3.0


class VllmClient(enum.StrEnum):
    """How a worker that starts vLLM talks to it (:mod:`workers.engines.vllm.backend`)."""

    AUTO = "auto"  # in-process in a worker's own process; api-server beside a frontend
    IN_PROCESS = "in-process"  # vLLM's engine client in the worker, its core a child
    API_SERVER = "api-server"  # `vllm serve` as a child, its token-in API over HTTP


@dataclass(frozen=True, slots=True)
class VllmConfig(EngineConfig):
    """How a worker reaches vLLM. Raises ``ValueError`` on construction for values out
    of range; an empty config (no model, no URL) is valid, and refused when an engine
    is built from it (:func:`workers.engines.vllm.engine.build_engine`)."""

    #: A model directory (config.json, weights; tokenizer files optional): the worker
    #: starts ``vllm serve`` on it. With ``vllm_url`` it is only read (vocabulary).
    model: str = field(default="", metadata={"help": "model directory: start a vLLM server on it"})
    #: A running vLLM server to use instead of starting one (``http://host:port``).
    vllm_url: str = field(
        default="", metadata={"help": "attach to the vLLM server at this URL instead"}
    )
    #: How a started vLLM is reached: its engine client in the worker's process
    #: (``in-process``: no API server, no HTTP hop; docs/performance-vllm.md), or its
    #: own API server (``api-server``). ``auto``: in-process where the worker has a
    #: process of its own (``headwater worker``, ``launch``), the API server for
    #: ``headwater serve``'s in-process workers, whose process is the frontend's
    #: (vLLM's client would hold the GIL beside its loop). ``--vllm-url`` is always
    #: an API server.
    vllm_client: VllmClient = field(
        default=VllmClient.AUTO,
        metadata={"help": "how a started vLLM is reached (auto, in-process, api-server)"},
    )
    #: More ``vllm serve`` options for a started server, one shell-quoted string.
    vllm_args: str = field(
        default="", metadata={"help": 'more vllm serve options: "--max-num-seqs 64"'}
    )
    #: The command that runs vLLM's CLI, shell-quoted; empty: this interpreter with
    #: headwater's launcher (``python -m workers.engines.vllm.launcher``), which also
    #: makes the server exit when its worker dies.
    vllm_command: str = field(
        default="", metadata={"help": "command running vLLM's CLI (default: this Python)"}
    )
    #: ``--max-model-len`` of a started server (tokens: prompt + completion).
    max_model_len: int = field(default=8192, metadata={"help": "vLLM's context length"})
    #: Start vLLM without graph compilation: ~40 s instead of ~50-90 s to start on CPU,
    #: decode ~30% slower.
    enforce_eager: bool = field(
        default=False, metadata={"help": "start vLLM with --enforce-eager (faster start)"}
    )
    #: ``VLLM_CPU_KVCACHE_SPACE`` of a started server (GiB; the CPU build's "0 = auto"
    #: fails). Ignored by GPU builds.
    cpu_kv_cache_gib: int = field(default=1, metadata={"help": "KV cache GiB of a vLLM CPU build"})
    #: ``VLLM_CPU_OMP_THREADS_BIND`` of a started CPU server: the cores its engine's
    #: OpenMP threads run on ("0", "0-3"). "role": a prefill server the first usable
    #: core, a decode server the last, an aggregated one vLLM's choice. Empty: vLLM's
    #: choice, which for a prefill or decode server on 2 cores is both (it reserves a
    #: core for NIXL and finds none left), so a pair's spinning threads fight.
    cpu_bind: str = field(
        default="", metadata={"help": "cores of a vLLM CPU engine (0-1, or role)"}
    )
    #: NIXL's KV buffer (``kv_buffer_device``): "cpu" here, "cuda" on GPUs.
    kv_buffer_device: str = field(
        default="cpu", metadata={"help": "NIXL KV buffer device (cpu, cuda)"}
    )
    #: Seconds a started server gets to answer ``/health`` (compiled cold starts take
    #: ~90 s on CPU).
    vllm_start_timeout: float = field(
        default=300.0, metadata={"help": "seconds vLLM gets to become healthy"}
    )
    #: Seconds between two polls of vLLM's ``/metrics`` (load and health).
    metrics_interval: float = field(
        default=0.5, metadata={"help": "seconds between polls of vLLM's /metrics"}
    )
    #: Times a started server that died is started again; after that the worker fails.
    vllm_restarts: int = field(
        default=3, metadata={"help": "times a dead vLLM is started again before the worker exits"}
    )
    #: A decode leg's first token must come within this (seconds, the KV transfer
    #: included), else it fails as kv_transfer_failed and the frontend prefills again.
    kv_pull_timeout: float = field(
        default=60.0, metadata={"help": "seconds a decode leg waits for its first token"}
    )
    #: NIXL's ``kv_lease_duration`` of a started prefill server (seconds): KV no
    #: decode pulled is freed after it; a decode waiting to pull extends it with
    #: heartbeats. vLLM's default.
    kv_lease_duration: int = field(
        default=30, metadata={"help": "seconds a prefill vLLM holds KV nobody pulled"}
    )
    #: Token ids must stay below this; 0: the model's (its config.json).
    #: One name with the frontend's option of the same meaning: ``serve
    #: --model-vocab-size`` sets both.
    vocab_size: int = field(
        default=0,
        metadata={
            "help": "the model's vocabulary size (0: from its config.json)",
            "flags": ("--model-vocab-size",),
        },
    )
    #: ``--block-size`` of a started server: the tokens of one KV block, which its KV
    #: events report and the frontend's ``--kv-block-size`` must match (the launcher and
    #: ``serve`` pass it on; docs/routing.md). vLLM's CPU build defaults to 128.
    vllm_block_size: int = field(
        default=64, metadata={"help": "tokens per KV block of a started vLLM (its --block-size)"}
    )
    #: A started server publishes its KV cache events (``--kv-events-config``, ZMQ on
    #: loopback) and the worker republishes them for ``--router kv``; off, or attached to
    #: ``--vllm-url``, the router uses its approximate mode for this worker.
    vllm_kv_events: bool = field(
        default=True, metadata={"help": "read a started vLLM's KV cache events (for --router kv)"}
    )
    #: Where a started server writes its output; empty: this process's stderr.
    vllm_log: str = field(default="", metadata={"help": "file for vLLM's output"})
    #: Consecutive failed polls (metrics, health) after which an attached server
    #: counts as down.
    down_after_polls: int = 3

    def __post_init__(self) -> None:
        # A string for the enum becomes its member; ValueError names the choices.
        object.__setattr__(self, "vllm_client", VllmClient(self.vllm_client))
        if self.vllm_url and not self.vllm_url.startswith(("http://", "https://")):
            raise ValueError(f"--vllm-url wants http://host:port, got {self.vllm_url!r}")
        for name in (
            "max_model_len",
            "cpu_kv_cache_gib",
            "down_after_polls",
            "kv_lease_duration",
            "vllm_block_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("vllm_start_timeout", "metrics_interval", "kv_pull_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.vllm_restarts < 0 or self.vocab_size < 0:
            raise ValueError("vllm_restarts and model_vocab_size must be >= 0")
        shlex.split(self.vllm_args)  # ValueError for an unbalanced quote
        shlex.split(self.vllm_command)

    def preflight(self) -> None:
        """The checks a command runs before it starts anything slow (a vLLM that would
        be waited for up to ``vllm_start_timeout``): a model directory that is there, a
        vocabulary size, an attached server whose address accepts a connection (its
        ``/health`` may still say it is starting: that is waited for). Raises ValueError
        with one line naming the option."""
        if not self.model and not self.vllm_url:
            raise ValueError("the vllm engine needs --model PATH or --vllm-url URL")
        if self.model and not self.vllm_url and not Path(self.model).is_dir():
            raise ValueError(
                f"--model {self.model}: no such directory (vLLM is started on a local model "
                "directory; for a server running elsewhere pass --vllm-url URL)"
            )
        if self.vllm_url:
            parts = urlsplit(self.vllm_url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                socket.create_connection((parts.hostname or "", port), PROBE_TIMEOUT).close()
            except OSError as exc:
                reason = exc.strerror or type(exc).__name__
                if isinstance(exc, TimeoutError):
                    reason = f"no answer within {PROBE_TIMEOUT:g} s"
                raise ValueError(
                    f"--vllm-url {self.vllm_url}: cannot connect ({reason}); is vLLM running there?"
                ) from exc
        if self.model_vocab_size() is None:
            raise ValueError(NO_VOCABULARY)

    @property
    def attached(self) -> bool:
        """True when the worker uses a vLLM server it did not start."""
        return bool(self.vllm_url)

    def model_dir(self) -> Path | None:
        """The model directory, when there is one on this machine."""
        path = Path(self.model) if self.model else None
        return path if path is not None and path.is_dir() else None

    def model_vocab_size(self) -> int | None:
        """``vocab_size`` if set, else the model's config.json's; None when unknown.

        Raises ValueError for a config.json that cannot be read.
        """
        if self.vocab_size:
            return self.vocab_size
        directory = self.model_dir()
        if directory is None or not (directory / "config.json").is_file():
            return None
        return read_vocab_size(directory / "config.json")

    def frontend_defaults(self) -> dict[str, Any]:
        """The model directory's tokenizer (when it has one), the model's vocabulary
        size and context length, one frontend process for in-process vLLM workers
        (:meth:`frontend_processes`) and the KV block size its events report. Raises
        ValueError for a model directory that cannot be read."""
        defaults: dict[str, Any] = {
            "context_length": self.max_model_len,
            "processes": self.frontend_processes(),
            "kv_block_size": self.vllm_block_size,
        }
        if path := self.tokenizer_path():
            defaults["tokenizer"] = path
        if size := self.model_vocab_size():
            defaults["model_vocab_size"] = size
        return defaults

    @property
    def start_timeout(self) -> float:
        return self.vllm_start_timeout

    def frontend_processes(self) -> int:
        """In-process vLLM workers want one frontend process: each process of a group
        would start its own vLLM children, each with the whole KV cache and a share of
        the cores (``--processes auto`` means 1 here; an explicit N is obeyed)."""
        return 1

    def tokenizer_path(self) -> str | None:
        """The model directory when it holds a tokenizer (the frontend's default then)."""
        directory = self.model_dir()
        if directory is not None and (directory / "tokenizer.json").is_file():
            return str(directory)
        return None


def read_vocab_size(config_json: Path) -> int:
    """The ``vocab_size`` of a Hugging Face config.json (top level, or the text
    config's of a multimodal model). Raises ValueError."""
    try:
        data = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {config_json}: {exc}") from exc
    for where in (data, data.get("text_config") or {}):
        value = where.get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{config_json} has no vocab_size")
