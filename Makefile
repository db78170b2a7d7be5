# The README's two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv/ and install everything they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvstore-installed

.PHONY: all build demo test bench clean

all: build

# fio is the device-limit reference of the benchmarks (Debian package).
/usr/bin/fio:
	@command -v fio >/dev/null 2>&1 || { (apt-get update -q && apt-get install -y -q fio) >/dev/null 2>&1 || \
	  echo "warning: could not install fio; benchmarks will skip it"; }

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# Build requirements first, so the extension build below can skip isolation (the
	# liburing sdist compiles its bundled C library once, not twice).
	$(PIP) install -q "liburing==2024.5.3" "Cython>=3.0,<3.1" "numpy>=1.26"
	$(PIP) install -q --no-build-isolation -e ".[test,vllm,bench]"
	touch $(STAMP)

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

demo: build /usr/bin/fio
	$(VENV)/bin/kvstore demo

test: build /usr/bin/fio
	$(PY) -m pytest -q tests

clean:
	rm -rf build kvstore/*.so *.egg-info
