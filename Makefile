# adapipe: `make train` and `make test` set everything up themselves (a virtual environment in
# .venv with the package installed). An installed torch is reused: the venv sees the system's
# site-packages, and torch is installed only when none can be imported.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch to install when none is importable; 2.13.0 is a CPU build on the machines this project
# is developed on (use TORCH=torch for your platform's default build)
TORCH ?= torch==2.13.0
OFFLINE := HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
ARGS ?=

.PHONY: install train test test-all bench reproduce-smoke reproduce clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

train: install
	$(VENV)/bin/adapipe train $(ARGS)

# the package's bytecode is compiled first: where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines), every adapipe process a test starts would compile it again (about 1 s each)
test: install
	$(PY) -m compileall -q src
	$(OFFLINE) $(PY) -m pytest

test-all: install
	$(PY) -m compileall -q src
	$(OFFLINE) $(PY) -m pytest -m "slow or not slow"

# every benchmark runs even if one before it fails; make fails at the end if any did (bench_sim.py
# exits 1 when it misses its goal; the others print their figures against their goals and exit 1
# only when they cannot run)
bench: install
	status=0; \
	$(OFFLINE) $(PY) scripts/bench_train.py || status=1; \
	$(OFFLINE) $(PY) scripts/bench_local.py || status=1; \
	$(OFFLINE) $(PY) scripts/bench_sim.py || status=1; \
	$(OFFLINE) $(PY) scripts/bench_dist.py || status=1; \
	exit $$status

# a sweep resumes where it stopped: rerun the same target after an interruption
reproduce-smoke: install
	$(OFFLINE) $(VENV)/bin/adapipe sweep sweep=smoke $(ARGS)

# the two grids (AdamW, then Muon), each about 4 hours on 2 cores; the second runs even if a cell
# of the first failed, and make fails if either did
reproduce: install
	$(OFFLINE) $(VENV)/bin/adapipe sweep sweep=cpu-adamw $(ARGS); status=$$?; \
	$(OFFLINE) $(VENV)/bin/adapipe sweep sweep=cpu-muon $(ARGS) && exit $$status

clean:
	rm -rf build dist src/*.egg-info .pytest_cache $(VENV)
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
