"""headwater with upstream vLLM on a CUDA machine: the checks and the benchmarks, as is.

    pip install vllm nixl          # upstream vLLM with CUDA, and NIXL, in this venv
    python scripts/gpu_vllm.py --model /models/Qwen2.5-0.5B-Instruct [--out bench-results/gpu]

Needs a GPU (it says so and stops without one) and a model directory on local disk with
its tokenizer (``tokenizer.json``) and ``config.json``; nothing is downloaded. It runs:

1. **Exactness**: three ``headwater worker --engine vllm`` processes, each starting
   upstream ``vllm serve`` (``--vllm-command vllm``): an aggregated one, and a prefill +
   decode pair with NIXL (``--kv-buffer-device cuda``; on one GPU they share it, each
   with ``--gpu-memory-utilization 0.28``; with two or more, prefill on GPU 0 and decode
   on GPU 1). Greedy output through headwater equals vLLM's own
   ``/inference/v1/generate`` for several prompts and for concurrent ones; prefill then
   decode equals one server for prompts below and above one KV block, and the decode
   server's metrics show the prompt tokens came over NIXL.
2. **Benchmarks**: ``scripts/bench_vllm.py`` with ``--compiled --vllm-command vllm``
   (the frontend's cost against vLLM's own API server at c4/c16 with ~2k and ~7k-token
   prompts; the ``/v1/models`` probe under 16 distinct ~40k-token prompts, if the
   model's context allows; KV transfer time and decode tokens/s, disaggregated
   against aggregated).

Exit status: 0 when every check passed, 1 when one failed, 2 without a GPU or a model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def gpus() -> int:
    """CUDA devices visible here (0 without a driver)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


class Worker:
    """One ``headwater worker --engine vllm`` process starting upstream vLLM."""

    def __init__(
        self, role: str, model: Path, workdir: Path, env: dict[str, str], vllm_args: str
    ) -> None:
        self.role = role
        self.out = workdir / f"{role}.out"
        self.err = workdir / f"{role}.err"
        argv = [
            sys.executable,
            "-m",
            "headwater",
            "worker",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--role",
            role,
            "--vllm-command",
            "vllm",
            "--kv-buffer-device",
            "cuda",
            "--listen",
            "127.0.0.1:0",
            "--worker-id",
            f"gpu-{role}",
            f"--vllm-args={vllm_args}",
            "--vllm-log",
            str(workdir / f"vllm-{role}.log"),
        ]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=err,
                cwd=REPO,
                env={**os.environ, **env},
                start_new_session=True,
            )
        self.address = self.worker_id = self.vllm_url = ""

    def ready(self) -> bool:
        match = re.search(r"HEADWATER_WORKER_READY (\S+) (\S+)", self.out.read_text())
        if match is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} worker exited: {self.err.read_text()[-3000:]}")
            return False
        self.address, self.worker_id = match.groups()
        self.vllm_url = re.findall(r"starting vLLM on (http://\S+):", self.err.read_text())[-1]
        return True

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with_kill(self.process.pid)


def with_kill(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


async def checks(workers: dict[str, Worker], vocab: int) -> list[str]:
    """The exactness and disaggregation checks; the failures, as lines."""
    import trio

    from headwater.plane.base import WorkerInstance
    from headwater.plane.client import connect_worker
    from headwater.wire import GenerateRequest, Role, SamplingParams

    failures: list[str] = []

    def prompt(n: int, salt: int) -> list[int]:
        return [100 + (i * 7919 + salt * 104729) % (vocab - 200) for i in range(n)]

    async def reference(url: str, ids: list[int], n: int) -> list[int]:
        async with httpx.AsyncClient(timeout=300) as http:
            r = await http.post(
                url + "/inference/v1/generate",
                json={"token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": n}},
            )
        r.raise_for_status()
        return list(r.json()["choices"][0]["token_ids"])

    def instance(w: Worker) -> WorkerInstance:
        return WorkerInstance(w.worker_id, Role(w.role), "deepseek-v4", w.address)

    def req(rid: str, ids: list[int], n: int, handle: Any = None) -> GenerateRequest:
        return GenerateRequest(
            rid, "deepseek-v4", ids, SamplingParams(max_tokens=n, temperature=0.0), handle
        )

    async def run(client: Any, r: GenerateRequest) -> list[Any]:
        async with client.stream(r) as replies:
            return [c async for c in replies]

    async with trio.open_nursery() as nursery:
        agg = await connect_worker(instance(workers["agg"]), nursery)
        pre = await connect_worker(instance(workers["prefill"]), nursery)
        dec = await connect_worker(instance(workers["decode"]), nursery)
        url = workers["agg"].vllm_url
        for n in (5, 130, 1000):
            ids = prompt(n, n)
            want = await reference(url, ids, 16)
            got = [t for c in await run(agg, req(f"a{n}", ids, 16)) for t in c.token_ids]
            print(f"agg   {n:5d} tokens: {'same' if got == want else 'DIFFERENT'}")
            if got != want:
                failures.append(f"agg output differs from vLLM's own for a {n}-token prompt")
        prompts = [prompt(50 + 40 * i, 50 + i) for i in range(8)]
        wanted = [await reference(url, p, 16) for p in prompts]
        got_all: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            chunks = await run(agg, req(f"c{i}", prompts[i], 16))
            got_all[i] = [t for c in chunks for t in c.token_ids]

        async with trio.open_nursery() as batch:
            for i in range(len(prompts)):
                batch.start_soon(one, i)
        same = all(got_all[i] == wanted[i] for i in range(len(prompts)))
        print(f"agg   8 concurrent: {'same' if same else 'DIFFERENT'}")
        if not same:
            failures.append("concurrent agg output differs from vLLM's own")
        for n in (100, 300, 2000):
            ids = prompt(n, 1000 + n)
            want = await reference(url, ids, 16)
            (handoff,) = await run(pre, req(f"pd{n}", ids, 16))
            chunks = await run(dec, req(f"pd{n}", ids, 16, handoff.kv_handle))
            got = [t for c in chunks for t in c.token_ids]
            print(f"disagg {n:5d} tokens: {'same' if got == want else 'DIFFERENT'}")
            if got != want:
                failures.append(f"disaggregated output differs for a {n}-token prompt")
        nursery.cancel_scope.cancel()
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(workers["decode"].vllm_url + "/metrics")).text
    moved = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total")
        and 'source="external_kv_transfer"' in line
    )
    print(f"decode prompt tokens over NIXL: {moved:.0f}")
    if moved < 2400:
        failures.append(f"the decode server counted {moved:.0f} prompt tokens from NIXL, not 2400")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=False)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "gpu")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="benchmark rounds, the peers alternating (medians over them)",
    )
    args = parser.parse_args()
    count = gpus()
    if count == 0:
        print(
            "gpu_vllm.py: no CUDA GPU here (nvidia-smi lists none): this script runs the vLLM "
            "checks and benchmarks on a GPU machine; stopping.",
            file=sys.stderr,
        )
        return 2
    if args.model is None or not (args.model / "config.json").is_file():
        print(
            "gpu_vllm.py: --model must be a local model directory with config.json", file=sys.stderr
        )
        return 2
    if shutil.which("vllm") is None:
        print("gpu_vllm.py: no `vllm` command: pip install vllm nixl", file=sys.stderr)
        return 2
    vocab = json.loads((args.model / "config.json").read_text()).get("vocab_size", 32000)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-vllm-"))
    share = "--gpu-memory-utilization 0.28 --max-model-len 8192"
    env_for = {
        "agg": {"CUDA_VISIBLE_DEVICES": "0"},
        "prefill": {"CUDA_VISIBLE_DEVICES": "0"},
        "decode": {"CUDA_VISIBLE_DEVICES": "1" if count > 1 else "0"},
    }
    workers = {role: Worker(role, args.model, workdir, env, share) for role, env in env_for.items()}
    try:
        deadline = time.monotonic() + 900
        while not all(w.ready() for w in workers.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the vLLM workers did not start in 900 s")
            time.sleep(1)
        import trio

        failures = trio.run(checks, workers, vocab)
    finally:
        for w in workers.values():
            w.stop()
    for line in failures:
        print(f"FAILED: {line}")
    if not args.skip_bench:
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "bench_vllm.py"),
                "--model",
                str(args.model),
                "--out",
                str(args.out),
                "--compiled",
                "--vllm-command",
                "vllm",
                "--kv-buffer-device",
                "cuda",
                "--rounds",
                str(args.rounds),
            ],
            check=False,
            cwd=REPO,
        )
    print(f"# logs in {workdir}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
