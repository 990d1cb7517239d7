# `make run`: set up .venv when missing, then run the whole DAG (dvc repro) on the embedded default data.
# `make test`: same set-up, then the whole test suite, slow end-to-end tests included (.ci/run calls this).
# `make smoke`: same set-up, then the whole DAG on configs/tiny.yaml in a scratch repo .smoke/ (minutes).
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed-stamp
# The exact version of every package `make install` installs; `make lock` writes it anew.
CONSTRAINTS ?= constraints.txt
LOCK_VENV := .lock-venv

# Nothing at run time may download: the default pipeline and the tests run offline.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: install run smoke test test-fast browser postgres lock

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: this machine's CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install --quiet torch==2.13.0
	# Every other package at the version constraints.txt names, so every fresh clone gets the same environment.
	$(VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

# constraints.txt afresh: the newest versions pyproject.toml allows, resolved in a scratch venv (minutes), frozen.
# Left out: llmpipe itself and pip; a local build tag is dropped (torch 2.13.0+cpu → 2.13.0), so the CUDA build of
# the same torch satisfies it too.
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install --quiet -e '.[test]'
	{ echo "# Exact versions for make install (pip install -c constraints.txt), resolved on Python" \
	    "$$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version(), platform.machine())')."; \
	  echo "# Written by make lock, which resolves pyproject.toml afresh; do not edit by hand."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable --exclude pip | sed -E 's/^([^=]+==[^+]*)\+.*$$/\1/'; \
	} > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	rm -rf $(LOCK_VENV)

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

# The flow's end-to-end tests run on PostgreSQL too (tests/postgres.py starts one on loopback): Debian's package,
# installed here where apt-get can; anywhere else those tests are skipped and say why.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get update -qq && apt-get install -y -qq postgresql; } >/dev/null 2>&1; } || \
	  echo "no PostgreSQL: the flow's PostgreSQL tests will be skipped (Debian: apt-get install postgresql)"

# The suite on every core (pytest-xdist), then the tests of the trained DAG in one process, in order (they share
# its repo and a Prefect server); fails if either part fails. TEST_WORKERS=0 runs the first part in one process.
TEST_WORKERS ?= auto

test: install browser postgres
	pytest -n $(TEST_WORKERS) --dist loadgroup -m "not dag"; first=$$?; pytest -m dag; second=$$?; \
	  exit $$(( first || second ))

# Development loop: everything but the end-to-end tests that train models.
test-fast: install
	pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow"
