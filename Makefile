# `make run`: set up .venv when missing, then run the whole DAG (dvc repro) on the embedded default data.
# `make test`: same set-up, then the whole test suite, slow end-to-end tests included (.ci/run calls this).
# `make smoke`: same set-up, then the whole DAG on configs/tiny.yaml in a scratch repo .smoke/ (minutes).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-stamp

# Nothing at run time may download: the default pipeline and the tests run offline.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: install run smoke test test-fast browser

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: this machine's CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The offline page template of `dvc plots show` (.dvc/config: plots.html_template): vega inlined from an installed
# package, so the plots page needs no network.
.dvc/plots_page.html: $(STAMP)
	$(VENV)/bin/python -m llmpipe.report.plots_page $@

install: $(STAMP) .dvc/plots_page.html

run: install
	dvc repro

# The workspace's own outputs (data/, models/, dvc.lock, …) are left as they are.
smoke: install
	python scripts/smoke.py

# The report page's browser test opens it in headless Chromium: Debian's package, installed here where apt-get
# can (CI runs as root on Debian); anywhere else the test is skipped and says why.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get update -qq && apt-get install -y -qq chromium; } >/dev/null 2>&1; } || \
	  echo "no chromium: the report page's browser test will be skipped (Debian: apt-get install chromium)"

test: install browser
	pytest

# Development loop: everything but the end-to-end tests that train models.
test-fast: install
	pytest -m "not slow"
