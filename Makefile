# `make demo`: create .venv if needed, install mindmon and its pinned dependencies, train the demo.
# `make test`: the same install plus pytest, then the system packages the tests run for real (`make services`:
# tools/test_services.sh installs the missing ones under root, names them otherwise), then the whole test suite
# (what .ci/run does) in two phases: the tests not marked `serial` on $(TEST_WORKERS) pytest-xdist workers, then
# the `serial` ones (timed, process-killing or 4-rank tests) alone (docs/testing.md).
# `make test-ms27`: the low end of the supported range (MindSpore 2.7.0 + mindnlp 0.5.1, no MindFormers) in
# .venv-ms27, pinned by constraints-ms27.txt; runs the tests marked `ms27` (docs/testing.md).
# `make test-ms210`: the newest MindSpore, 2.10.0 (MindFormers 1.9 needs 2.9: none here) in .venv-ms210, pinned
# by constraints.txt with its MindSpore pin replaced; runs the same `ms27` core set.
# Versions are pinned by constraints.txt; `pip install mindmon` alone never installs or replaces MindSpore.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VENV_MS27 ?= .venv-ms27
BIN_MS27 := $(VENV_MS27)/bin
VENV_MS210 ?= .venv-ms210
BIN_MS210 := $(VENV_MS210)/bin
# CI's machine has two cores; most tests run MindSpore's own threads and msrun tests start 2 workers each, so
# more pytest workers than cores only add contention. Whole files go to one worker (--dist loadfile): a module's
# fixtures (a trained run its tests share) are built once.
TEST_WORKERS ?= 2

# $(call two_phases,PYTHON,MARKER EXPRESSION): the tests it selects that are not `serial` on $(TEST_WORKERS)
# workers, then the `serial` ones in one process; both phases run, and either failing fails the target.
# pytest's 5 (nothing selected) is not a failure: a set may have no serial test (but .ci/run must not end on
# such a phase: CI reads its last closing line).
define two_phases
	status=0; \
	$(1) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "$(2) and not serial" tests || [ $$? -eq 5 ] || status=1; \
	$(1) -m pytest -q -m "$(2) and serial" tests || [ $$? -eq 5 ] || status=1; \
	exit $$status
endef

.PHONY: install demo lint services install-msprobe test install-ms27 test-ms27 install-ms210 test-ms210 clean

install:
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=23"
	$(BIN)/python -m pip install -q -c constraints.txt ".[mindspore,all,test]"
	@rm -rf build mindmon.egg-info

demo: install
	$(BIN)/mindmon demo

services:
	@bash tools/test_services.sh

# msprobe itself (mindstudio-probe 26.2.0 beside MindSpore 2.9.0), apart from mindmon's environment: the tests
# that compare mindmon's files with msprobe's run it in a subprocess (MSPROBE_V2_PYTHON).
VENV_MSPROBE ?= .venv-msprobe
install-msprobe:
	@test -x $(VENV_MSPROBE)/bin/python || $(PYTHON) -m venv $(VENV_MSPROBE)
	$(VENV_MSPROBE)/bin/python -m pip install -q "mindspore==2.9.0" "mindstudio-probe==26.2.0" "numpy==1.26.4"

lint: install
	$(BIN)/ruff check mindmon tools tests

test: install lint services install-msprobe
	$(call two_phases,MSPROBE_V2_PYTHON=$(abspath $(VENV_MSPROBE))/bin/python $(BIN)/python,not mindnlp and not mindformers2)

install-ms27:
	@test -x $(BIN_MS27)/python || $(PYTHON) -m venv $(VENV_MS27)
	$(BIN_MS27)/python -m pip install -q --upgrade "pip>=23"
	$(BIN_MS27)/python -m pip install -q -c constraints-ms27.txt ".[mindspore,mindnlp,report,analysis,prometheus,test]"
	@rm -rf build mindmon.egg-info

# The core set in two phases, then mindnlp's tests in a process of their own: `import mindnlp` changes
# mindspore.Tensor for the whole process it runs in (one process: each worker would pay that import).
test-ms27: install-ms27
	$(call two_phases,$(BIN_MS27)/python,ms27 and not mindformers and not mindnlp)
	$(BIN_MS27)/python -m pytest -q -m "mindnlp" tests

# MindFormers 2.0.0 goes in with --no-deps (it requires hyper-parallel, which no registry serves), then its
# other requirements from its own metadata; the tests put a single-device hyper_parallel stand-in on sys.path.
MS210_PINNED := $(shell grep -v '^\#' constraints-ms210.txt | cut -d= -f1 | paste -sd'|' -)

install-ms210:
	@test -x $(BIN_MS210)/python || $(PYTHON) -m venv $(VENV_MS210)
	$(BIN_MS210)/python -m pip install -q --upgrade "pip>=23"
	grep -v -E '^($(MS210_PINNED))==' constraints.txt > $(VENV_MS210)/constraints.txt
	grep -v '^#' constraints-ms210.txt >> $(VENV_MS210)/constraints.txt
	$(BIN_MS210)/python -m pip install -q -c $(VENV_MS210)/constraints.txt \
		".[mindspore,tensorboard,report,alerts,analysis,distributed,prometheus,test]"
	$(BIN_MS210)/python -m pip install -q --no-deps -c $(VENV_MS210)/constraints.txt mindformers
	$(BIN_MS210)/python tools/mindformers_requirements.py > $(VENV_MS210)/mindformers-requirements.txt
	$(BIN_MS210)/python -m pip install -q -c $(VENV_MS210)/constraints.txt -r $(VENV_MS210)/mindformers-requirements.txt
	@# MindFormers 2.1.0's source, unpacked beside the environment, not installed (it requires MindSpore 2.11):
	@# tests/mindformers/test_mindformers21.py runs its Trainer in a process of its own
	test -d $(VENV_MS210)/mindformers-2.1.0/mindformers || ( \
		$(BIN_MS210)/python -m pip download -q --no-deps mindformers==2.1.0 -d $(VENV_MS210)/mindformers-2.1.0 && \
		$(BIN_MS210)/python -m zipfile -e $(VENV_MS210)/mindformers-2.1.0/mindformers-2.1.0-py3-none-any.whl \
			$(VENV_MS210)/mindformers-2.1.0 )
	@rm -rf build mindmon.egg-info

# MindFormers 2.0.0's Trainer (`mindformers2`, with the hyper_parallel stand-in; no serial test), then the core set.
test-ms210: install-ms210
	$(call two_phases,$(BIN_MS210)/python,mindformers2)
	$(call two_phases,$(BIN_MS210)/python,ms27 and not mindformers and not mindnlp)

clean:
	rm -rf $(VENV) $(VENV_MS27) $(VENV_MS210) $(VENV_MSPROBE) build mindmon.egg-info output
