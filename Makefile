# radixserve: `make run` serves the embedded default model, `make test` runs every test.
# Both set up .venv on a fresh machine first (idempotent; a no-op when pyproject.toml is unchanged).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch==2.13.0 (CPU build) lies in /opt/wheels on the development machines.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP    := $(PY) -m pip install -q --disable-pip-version-check $(FIND_LINKS)
PYTEST_ARGS ?=
# SGLang's frontend language, for the tests that run SGLang programs against radixserve
# (tests/e2e/test_sglang_programs.py). Without its dependencies: 0.5.x requires SGLang's
# whole server (torch 2.14 for CUDA, flashinfer, ...), and even this release lists packages
# its client never imports; the modules its `lang` package does import are in pyproject's
# dev extras. 0.4.10.post2 because its client imports with just those, and its
# RuntimeEndpoint speaks the same /generate wire as the newest client.
SGLANG_CLIENT := 'sglang==0.4.10.post2'
# SGLang's newest frontend language too, beside .venv (git-ignored), for the program tests
# that also run on it: 0.5.x imports with .venv's packages plus orjson and msgspec, and its
# client sends what 0.4.10's does not (stop_regex in every gen).
SGLANG_NEXT       := 'sglang==0.5.23' 'orjson==3.13.0' 'msgspec==0.23.0'
SGLANG_NEXT_DIR   := .sglang-next
SGLANG_NEXT_STAMP := $(SGLANG_NEXT_DIR)/.installed
# The GPU machine's Triton, installed beside .venv for the compile rehearsal (git-ignored).
DEVICE_TRITON   := 'triton==3.6.*'
REHEARSAL       := .gpu-rehearsal
REHEARSAL_STAMP := $(REHEARSAL)/.installed

.PHONY: setup run test test-fast lint format bench bench-seeds bench-peers protos clean gpu-rehearsal gpu-wheels system-deps sglang-next

setup: $(STAMP) system-deps

# Debian's redis-server, for the storage tier's Redis backend tests (tests/redis_util.py
# starts one per test module on a free loopback port; without it those tests skip, or fail
# under CI), and openssl, whose CLI makes the TLS tests' throwaway certificates.
system-deps:
	@command -v redis-server >/dev/null || { \
		echo "setup: installing redis-server (Debian's package)"; \
		(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
		|| echo "setup: could not install redis-server; the Redis storage tests will skip"; }
	@command -v openssl >/dev/null || { \
		echo "setup: installing openssl (the TLS tests make their certificates with it)"; \
		(apt-get update -qq && apt-get install -y -qq openssl >/dev/null) \
		|| echo "setup: could not install openssl; the TLS tests will fail"; }

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps $(SGLANG_CLIENT)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/radixserve serve --port 30000

test: $(STAMP) $(REHEARSAL_STAMP) $(SGLANG_NEXT_STAMP) system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

# An unreachable registry leaves no stamp: the test on the newest client then skips, saying why.
$(SGLANG_NEXT_STAMP): | $(STAMP)
	rm -rf $(SGLANG_NEXT_DIR)
	$(PIP) --no-deps --target $(SGLANG_NEXT_DIR)/site $(SGLANG_NEXT) \
		&& touch $@ || echo "sglang-next: could not install $(SGLANG_NEXT); its test will skip"

sglang-next: $(SGLANG_NEXT_STAMP)

# The GPU machine's Triton (3.6) beside .venv's, for compiling every kernel the GPU check
# launches for sm_90 here (bench/gpu_compile.py; tests/unit/test_kernels_compile.py runs it).
# An unreachable registry leaves no stamp: that test then skips and says why.
$(REHEARSAL_STAMP): | $(STAMP)
	rm -rf $(REHEARSAL)
	$(PIP) --no-deps --target $(REHEARSAL)/site $(DEVICE_TRITON) \
		&& touch $@ || echo "gpu-rehearsal: could not install $(DEVICE_TRITON); its test will skip"

gpu-rehearsal: $(REHEARSAL_STAMP)
	PYTHONPATH=$(REHEARSAL)/site:. $(PY) bench/gpu_compile.py

# The cp312 wheels the GPU machine lacks, into .whl/ (carried with the device call: docs/gpu.md).
gpu-wheels: $(STAMP)
	bash bench/gpu_wheels.sh

# Unit and property tests only: no server processes, no Helm (a couple of minutes).
test-fast: $(STAMP) system-deps
	$(PY) -m pytest -q tests/unit tests/property $(PYTEST_ARGS)

# What CI runs before the tests: lint, formatting and types (config in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) bench/bench_radix_cache.py

bench-seeds: $(STAMP)
	$(PY) bench/seed_experiments.py

# Regenerates the committed gRPC/protobuf stubs from protos/.
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/radixserve/v1/generation.proto protos/radixserve/internal/v1/engine.proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
