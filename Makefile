# Two commands: `make serve` and `make test` (each sets everything up first).
# `make docs` builds the documentation site into site/ (strict: a broken link fails).
.PHONY: setup serve test test-fast lint bench docs

export HF_HUB_OFFLINE := 1

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/npu-gateway serve $(ARGS)

test: setup
	bash scripts/test-services.sh
	.venv/bin/pytest -q $(PYTEST_ARGS)

test-fast: setup
	.venv/bin/pytest -q -m "not engine and not e2e" $(PYTEST_ARGS)

lint:
	.venv/bin/ruff check server engine_adapter tests bench
	.venv/bin/mypy

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
