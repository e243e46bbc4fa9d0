"""vLLM's engine inside the worker's process: no API server, no HTTP hop (:mod:`.backend`).

The worker runs vLLM's engine client, ``AsyncLLM`` (what vLLM's own API server runs, and
what Dynamo's vLLM worker runs), on an asyncio loop in a thread of its own
(:mod:`.asyncio_thread`); vLLM starts its engine core in a child process and speaks to
it over ZMQ, as always. Per request the worker hands vLLM the prompt's ids
(``tokens_input``) and a ``SamplingParams`` built from the same mapping the token-in
API's body carries (:meth:`~.protocol.VllmCall.sampling_params`), and reads
``RequestOutput`` deltas back as :class:`~.protocol.StreamEvent`, their logprobs in the
shapes vLLM's token-in API gives them (so both ways read them with one parser and give
the same numbers). Prompt logprobs come with the stream's first output: no extra request.

Why in-process: a request to vLLM's API server costs the worker an HTTP exchange and
the API server another (JSON, pydantic, SSE), 6-17 ms of CPU per request on this
machine's benchmark (docs/performance-vllm.md). Here it is one hop between two loops
of one process. The price is vLLM's Python interfaces (``AsyncLLM``, ``SamplingParams``,
``RequestOutput``, its engine arguments) instead of its HTTP API: vLLM is pinned, and
``tests/test_vllm_interfaces.py`` fingerprints what is used so an upgrade fails there.

Lifecycle: :meth:`~InProcessBackend.start` builds vLLM's engine arguments from the same
options a started server gets (:func:`~.server.engine_argv`), sets vLLM's environment in
this process (:func:`~.server.serve_env`: its children inherit it), and builds the
``AsyncLLM`` on the loop's thread (a minute on 2 cores: trio's loop runs meanwhile).
vLLM's own monitor marks the client dead when the engine core dies; :meth:`wait`
polls that mark. :meth:`stop` is vLLM's ``shutdown`` (the engine core terminated, then
killed). A worker killed outright cannot stop its engine core: the core watches its
parent itself (:mod:`.plugin`, a vLLM plugin) and stops once the worker is gone.

Load: vLLM records its Prometheus series in this process's default registry (the
worker's own metrics use registries of their own); :meth:`metrics` reads them with
the same parser as the API server's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Mapping
from contextlib import aclosing, asynccontextmanager, contextmanager, suppress
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.core import Metric

from headwater.orphans import SUPERVISOR_ENV
from headwater.wire import Role
from workers.engines.vllm import protocol
from workers.engines.vllm.asyncio_thread import AsyncioThread, open_asyncio_thread
from workers.engines.vllm.backend import ServedModel, VllmUnreachable, trace_headers
from workers.engines.vllm.config import VllmConfig
from workers.engines.vllm.plugin import HOST_ENV
from workers.engines.vllm.protocol import (
    DONE,
    ProtocolError,
    StreamEvent,
    VllmCall,
    VllmMetrics,
    VllmRequestError,
)
from workers.engines.vllm.server import VllmStartError, engine_argv, serve_env

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

#: Seconds between two looks at whether vLLM's engine core died.
DEATH_POLL_S = 0.5
#: Seconds vLLM's shutdown may take before its engine core is killed.
SHUTDOWN_S = 15.0

_STARTING = trio.Lock()  # see InProcessBackend.start


class InProcessBackend:
    """vLLM's ``AsyncLLM`` in this process; see the module docstring."""

    streams_prompt_logprobs = True

    def __init__(
        self, config: VllmConfig, role: Role, worker_id: str, *, otlp_endpoint: str = ""
    ) -> None:
        self.config = config
        self.role = role
        self.worker_id = worker_id
        self.otlp_endpoint = otlp_endpoint
        self.events_endpoint = ""
        self._thread: AsyncioThread | None = None
        self._llm: AsyncLLM | None = None

    @property
    def attached(self) -> bool:
        return False

    @property
    def where(self) -> str:
        pids = ", ".join(str(pid) for pid in self.engine_core_pids())
        return f"in-process (engine core pid {pids or 'none'})"

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """The asyncio thread vLLM's client lives on, for the engine's life."""
        async with open_asyncio_thread(f"vllm-{self.worker_id}") as thread:
            self._thread = thread
            try:
                yield
            finally:
                self._thread = None

    async def start(self) -> ServedModel:
        thread = self._loop_thread()
        argv = engine_argv(
            self.config,
            self.role,
            otlp_endpoint=self.otlp_endpoint,
            events_endpoint=self.events_endpoint,
        )
        # vLLM reads its settings from the environment, and its engine core inherits
        # this process's: set before the first import of vLLM. The worker's own
        # supervisor stays its own; the core watches the worker (:mod:`.plugin`).
        env = serve_env(self.config, self.role, {}, traced=bool(self.otlp_endpoint))
        env.pop(SUPERVISOR_ENV, None)
        env[HOST_ENV] = str(os.getpid())
        log.info("%s: starting vLLM in-process: %s", self.worker_id, " ".join(argv))
        try:
            with trio.fail_after(self.config.vllm_start_timeout):
                # One start at a time in a process: vLLM's settings are this process's
                # environment, which its engine core inherits as it is spawned.
                async with _STARTING:
                    os.environ.update(env)
                    llm = await thread.call(lambda: _make_llm(argv))
        except trio.TooSlowError as exc:
            raise VllmStartError(
                f"vLLM not started within {self.config.vllm_start_timeout:g} s"
            ) from exc
        except Exception as exc:  # vLLM's own errors: a bad argument, a failed core
            raise VllmStartError(f"vLLM failed to start: {exc!r}") from exc
        self._llm = llm
        # vLLM brought torch and its own modules into this process: hundreds of
        # thousands of objects that live as long as it does. Frozen, the collector's
        # full passes leave them alone (seen unfrozen: a 0.41 s collection on the loop).
        gc.freeze()
        return ServedModel(self.config.model, llm.model_config.max_model_len)

    async def wait(self) -> str:
        while True:
            llm = self._llm
            if llm is not None and llm.errored:
                return "vLLM's engine core died"
            await trio.sleep(DEATH_POLL_S)

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None or self._thread is None:
            return
        with trio.move_on_after(SHUTDOWN_S + 5, shield=True):
            await self._thread.call(lambda: llm.shutdown(timeout=SHUTDOWN_S))

    def kill(self) -> None:
        for pid in self.engine_core_pids():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def engine_core_pids(self) -> list[int]:
        """The pids of vLLM's engine core processes (none before start)."""
        llm = self._llm
        if llm is None:
            return []
        manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
        processes: Iterable[Any] = getattr(manager, "processes", ())
        return [p.pid for p in processes if p.pid is not None]

    async def answer(self, call: VllmCall) -> StreamEvent:
        last: RequestOutput | None = None
        async with aclosing(self._outputs(call)) as outputs:
            async for output in outputs:
                last = output
        if last is None:
            raise ProtocolError("vLLM answered nothing")
        prompt = list(last.prompt_logprobs or ()) if call.prompt_logprobs else None
        return _event(last, call, prompt)

    async def stream(self, call: VllmCall) -> AsyncGenerator[StreamEvent, None]:
        # Streamed, vLLM may hand the prompt's logprobs over in pieces (an output with
        # none, a chunked prefill's share each): gathered, they go with the first token.
        gathered: list[Any] | None = [] if call.prompt_logprobs else None
        async with aclosing(self._outputs(call)) as outputs:
            async for output in outputs:
                if gathered is not None and output.prompt_logprobs:
                    gathered.extend(output.prompt_logprobs)
                first = output.outputs and (
                    output.outputs[0].token_ids or output.outputs[0].finish_reason
                )
                if gathered and first:
                    yield _event(output, call, gathered)
                    gathered = None
                else:
                    yield _event(output, call)
        yield DONE

    async def metrics(self) -> VllmMetrics:
        if self._llm is None or self._llm.errored:
            raise VllmUnreachable("vLLM is not running")
        text = await trio.to_thread.run_sync(_prometheus_text)
        return protocol.parse_metrics(text)

    def metric_families(self) -> Iterable[Metric]:
        if self._llm is None:
            return []
        from prometheus_client import REGISTRY

        return [family for family in REGISTRY.collect() if family.name.startswith("vllm:")]

    async def _outputs(self, call: VllmCall) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's outputs for *call*, each fetched on the asyncio loop; closing this
        generator early closes vLLM's, which aborts the request."""
        thread = self._loop_thread()
        llm = self._llm
        if llm is None or llm.errored:
            raise VllmUnreachable(f"{self.worker_id}: vLLM is not running")
        params = _sampling_params(call)
        ids = call.request.token_ids
        prompt = _tokens_input(list(ids))
        headers = trace_headers() or None
        stream = thread.stream(lambda: llm.generate(prompt, params, call.id, trace_headers=headers))
        async with aclosing(stream) as outputs:
            while True:
                with _vllm_errors():
                    output = await anext(outputs, None)
                if output is None:
                    return
                yield output

    def _loop_thread(self) -> AsyncioThread:
        if self._thread is None:
            raise RuntimeError("InProcessBackend used outside its open() block")
        return self._thread


def _make_llm(argv: list[str]) -> AsyncLLM:
    """vLLM's engine client for the ``vllm serve``-style *argv* (engine options only),
    made in the thread of the loop it will run on."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm"))
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(argv))
    return AsyncLLM.from_engine_args(args)


def _tokens_input(ids: list[int]) -> Any:
    from vllm.inputs import tokens_input

    return tokens_input(ids)


def _sampling_params(call: VllmCall) -> SamplingParams:
    """vLLM's ``SamplingParams`` for *call*: the token-in API's mapping, typed as its
    server would (token ids as ints, the structured output as its params), deltas
    when streamed, and the KV transfer's parameters."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    params = call.sampling_params()
    bias = params.pop("logit_bias", None)
    if bias is not None:
        params["logit_bias"] = {int(token): float(value) for token, value in bias.items()}
    structured = params.pop("structured_outputs", None)
    if structured is not None:
        params["structured_outputs"] = StructuredOutputsParams(**structured)
    if call.kv_transfer_params is not None:
        params["extra_args"] = {"kv_transfer_params": dict(call.kv_transfer_params)}
    kind = RequestOutputKind.DELTA if call.stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**params, output_kind=kind)
    except (ValueError, TypeError) as exc:
        raise VllmRequestError(400, str(exc)) from exc


def _event(
    output: RequestOutput, call: VllmCall, prompt_positions: list[Any] | None = None
) -> StreamEvent:
    """One of vLLM's outputs as an event, read as the token-in API's answer would be;
    *prompt_positions*: the prompt's logprobs to carry (all of them, as vLLM gave them)."""
    completion = output.outputs[0] if output.outputs else None
    tokens = list(completion.token_ids) if completion is not None else []
    finish = completion.finish_reason if completion is not None else None
    top = call.request.sampling.logprobs
    logprobs = None
    if top is not None and call.stream and completion is not None:
        raw = {"content": _token_logprobs(tokens, completion.logprobs or (), top)}
        logprobs = protocol.read_token_logprobs(raw, tokens, top)
    prompt = None
    prompt_top = call.request.sampling.prompt_logprobs
    if prompt_positions and prompt_top is not None:
        prompt = protocol.read_prompt_logprobs(_prompt_logprobs(prompt_positions), prompt_top)
    return StreamEvent(
        tokens,
        finish,
        output.num_cached_tokens if output.finished else None,
        output.kv_transfer_params,
        logprobs=logprobs,
        prompt_logprobs=prompt,
    )


def _clamp(logprob: float) -> float:
    """vLLM's API floor for a logprob: -inf and NaN become -9999.0."""
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)


def _token_logprobs(
    tokens: list[int], positions: Iterable[Mapping[int, Any] | None], top: int
) -> list[dict[str, Any]]:
    """Each token's logprobs as vLLM's token-in API writes them: the token's own
    logprob and rank, and the first ``max(top, 1)`` candidates in vLLM's order."""
    content: list[dict[str, Any]] = []
    for token, position in zip(tokens, positions, strict=False):
        own = position.get(token) if position is not None else None
        if position is None or own is None:
            content.append({"token_id": token, "logprob": -9999.0})
            continue
        candidates = list(position.items())[: max(top, 1)]
        content.append(
            {
                "token_id": token,
                "logprob": _clamp(own.logprob),
                "rank": own.rank or None,
                "top_logprobs": [
                    {"token_id": t, "logprob": _clamp(lp.logprob), "rank": lp.rank or None}
                    for t, lp in candidates
                ],
            }
        )
    return content


def _prompt_logprobs(positions: Iterable[Mapping[int, Any] | None]) -> list[Any]:
    """The prompt's logprobs as the token-in API writes them: None for the first
    position, then each position's candidates by id (-inf as -9999.0)."""
    return [
        None
        if position is None
        else {
            token: {
                "logprob": -9999.0 if lp.logprob == -math.inf else lp.logprob,
                "rank": lp.rank,
            }
            for token, lp in position.items()
        }
        for position in positions
    ]


@contextmanager
def _vllm_errors() -> Iterator[None]:
    """vLLM's exceptions as the backend's (:mod:`.backend`)."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:
        yield
    except EngineDeadError as exc:
        raise VllmUnreachable(f"vLLM's engine core is dead: {exc}") from exc
    except (VLLMClientError, ValueError, TypeError) as exc:
        raise VllmRequestError(400, str(exc)) from exc
    except EngineGenerateError as exc:
        raise VllmRequestError(500, repr(exc.__cause__ or exc)) from exc
    except asyncio.CancelledError as exc:  # its loop is stopping
        raise VllmUnreachable("vLLM's loop stopped") from exc


#: The samples :func:`~.protocol.parse_metrics` reads: rendering only their collectors
#: keeps each poll (every ``metrics_interval``, in a thread, holding the GIL) short.
_READ = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens_total",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:prompt_tokens_by_source_total",
    "vllm:cache_config_info",
)


def _prometheus_text() -> str:
    """The series the worker reads of vLLM's, from this process's default registry."""
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY.restricted_registry(_READ)).decode()
