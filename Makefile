# Two set-up commands: `make demo` and `make test`. Each creates .venv if it is missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEMO    ?= .demo
SAMPLE  := $(DEMO)/inputs/sample_manifest.json
export PYTHONHASHSEED := 0
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: install demo lint docs docs-check test test-heavy test-all bench mutate clean

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[sample,dev]'
	touch $(STAMP)

install: $(STAMP)

$(SAMPLE): $(STAMP)
	$(BIN)/lexiflow sample --out $(DEMO)/inputs

demo: $(SAMPLE)
	PREFECT_LOGGING_LEVEL=$${PREFECT_LOGGING_LEVEL:-INFO} $(BIN)/lexiflow run pipeline --config configs/demo.yaml \
	    --set store_uri=$(DEMO)/store \
	    --set 'prepare.corpus_uri=$(DEMO)/inputs/corpus/*.jsonl' \
	    --set prepare.embeddings_uri=$(DEMO)/inputs/tencent_sample.txt \
	    --set finetune.data_uri=$(DEMO)/inputs/sentiment.csv

# ruff, then the import contract ([tool.importlinter] in pyproject.toml: layers, rooms, no Prefect below flows/,
# no circles); lint-imports needs the checkout on the path to find the five packages.
lint: $(STAMP)
	$(BIN)/ruff check .
	PYTHONPATH=$(CURDIR) $(BIN)/lint-imports

# The docs site (mkdocs.yml, docs/): `make docs` regenerates the generated pages (docs/gen.py: the configuration
# and CLI references, the benchmark and quality tables, the error list) and builds the site into site/.
docs: $(STAMP)
	$(BIN)/python docs/gen.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# In `make test`: a stale generated page, a broken link, a page missing from the nav or any other build warning
# fails (seconds, offline). No --quiet: a warning that fails the build is printed.
docs-check: $(STAMP)
	$(BIN)/python docs/gen.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $$(mktemp -d)

# The suite on one worker per CPU this process may use (affinity and cgroup quota), at most 4; whole test files per
# worker (module fixtures are built once). TEST_WORKERS=0 runs it in this process. `make test` leaves out the few
# end-to-end tests of about a minute or more each (@pytest.mark.heavy: deployments through a worker, a worker
# elsewhere that clones and installs the code itself, the
# determinism module's pipeline runs, the GPU check's dry run, the DDP runs, the Dask runner, an imported checkpoint
# through the pipeline, relabel on promotion, the drift-alert deployment, a kill after every file operation of a
# checkpoint save, a stop in each phase of pretraining, the console script's offline run, last line and kill -9);
# `make test-heavy` runs them, `make test-all` both, and CI (.ci/run) runs both.
TEST_WORKERS ?= $$($(BIN)/python -c "from models.numerics import available_cpus; print(min(4, available_cpus()))")
PYTEST = PREFECT_LOGGING_LEVEL=WARNING $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15
test: lint docs-check
	$(PYTEST) -m "not heavy"

test-heavy: $(STAMP)
	$(PYTEST) -m heavy

test-all: test test-heavy

bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[sample,dev,bench]'
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# Mutation testing of the modules that guard data ([tool.mutmut] in pyproject.toml); fails under 90% killed.
mutate: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[sample,dev,mutate]'
	rm -rf mutants
	PREFECT_LOGGING_LEVEL=WARNING $(BIN)/mutmut run --max-children $${MUTATE_JOBS:-2} > /dev/null
	$(BIN)/mutmut export-cicd-stats
	$(BIN)/python -m tests.mutation_score mutants/mutmut-cicd-stats.json --min 90

clean:
	rm -rf $(DEMO) .pytest_cache .import_linter_cache site
