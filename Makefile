# `make demo`: create .venv if needed, install mindmon and its pinned dependencies, train the demo.
# `make test`: the same install plus pytest, then the whole test suite (what .ci/run does).
# Versions are pinned by constraints.txt; `pip install mindmon` alone never installs or replaces MindSpore.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test clean

install:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=23"
	$(BIN)/python -m pip install -q -c constraints.txt ".[mindspore,all,test]"
	@rm -rf build mindmon.egg-info

demo: install
	$(BIN)/mindmon demo

test: install
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build mindmon.egg-info output
