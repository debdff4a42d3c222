# Two commands: `make serve` and `make test` (each sets everything up first).
# `make docs` builds the documentation site into site/ (strict: a broken link fails).
.PHONY: setup serve test test-fast lint bench docs

export HF_HUB_OFFLINE := 1

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/npu-gateway serve $(ARGS)

# The fast tests run on both cores (pytest-xdist, a file per worker at a
# time); the engine and e2e tests run after them in one process, one at a
# time (an engine start takes both cores, and they share the session's real
# gateway). Both parts always run; the first failure's status is the result.
# A part that PYTEST_ARGS leaves empty (pytest's status 5) is no failure.
FAST := -m "not engine and not e2e" -n 2 --dist loadfile
SLOW := -m "engine or e2e"

test: setup
	bash scripts/test-services.sh
	@rc=0; \
	.venv/bin/pytest -q $(FAST) $(PYTEST_ARGS) || { s=$$?; [ $$s -eq 5 ] || rc=$$s; }; \
	.venv/bin/pytest -q $(SLOW) $(PYTEST_ARGS) || { s=$$?; [ $$s -eq 5 ] || rc=$$s; }; \
	exit $$rc

test-fast: setup
	.venv/bin/pytest -q $(FAST) $(PYTEST_ARGS)

lint:
	.venv/bin/ruff check server engine_adapter tests bench
	.venv/bin/mypy

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
