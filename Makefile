# headwater: the two commands a newcomer types are `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: serve test lint cluster bench soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,browser]'
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/headwater serve $(ARGS)

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check frontend workers headwater tests scripts
	$(VENV)/bin/mypy

cluster: $(STAMP)
	$(VENV)/bin/headwater launch --prefill 2 --decode 2 $(ARGS)

bench: $(STAMP)
	$(PY) -m scripts.bench.run $(ARGS)

# The soak: 10 min of mixed load per target (serve, launch); fails on a leak or a lost
# request (docs/reliability.md). Shorter: make soak ARGS="--duration 120".
soak: $(STAMP)
	$(PY) -m scripts.soak $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
