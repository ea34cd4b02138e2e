# Two user commands:
#   make check   set up .venv if needed, then `flashsink check` (golden problem vs the fp64 reference)
#   make test    set up .venv if needed, then the test suite
#
# Set-up runs once (a stamp file in the venv) and again when pyproject.toml changes.
# torch is installed first with an exact pin: on the CPU machines pip resolves that pin to a
# local CPU build, while an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
TORCH_PIN ?= torch==2.13.0

VPY := $(VENV)/bin/python
STAMP := $(VENV)/.flashsink-setup

.PHONY: check test

check: $(STAMP)
	$(VPY) -m flashsink check

test: $(STAMP)
	$(VPY) -m pytest -q -ra

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install "$(TORCH_PIN)"
	$(VPY) -m pip install -e ".[test]"
	touch $@
