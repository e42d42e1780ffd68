# mpi_fnas — the two commands of the quickstart:
#   make run    set up .venv if needed, then the default federated search (8 parties = 9 MPI ranks)
#   make test   set up .venv if needed, then every test (two lanes: the serial tests in two pytest-xdist workers;
#               beside them the Slurm and simulated-cluster tests, the AVX2 pass and the MPI tests under mpirun:
#               scripts/run_tests.sh), then ruff
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
MPIRUN := $(VENV)/bin/mpirun
NP     ?= 9
ARGS   ?=
# The MPI tests: a server and 3 parties (each test needs at most 3 ranks; 3 parties keep several mask pairs).
MPI_TEST_RANKS ?= 4
STAMP  := $(VENV)/.mpi_fnas-installed

.PHONY: setup run test test-serial test-mpi lint docs bench image clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt constraints-cpu.txt scripts/install.sh
	bash scripts/install.sh $(VENV)

run: $(STAMP)
	$(MPIRUN) -n $(NP) $(PYTHON) -m mpi_fnas.run $(ARGS)

test: $(STAMP)
	PYTHON=$(PYTHON) bash scripts/run_tests.sh

lint: $(STAMP)
	$(PYTHON) -m ruff check mpi_fnas tests

# The documentation site (mkdocs.yml) into site/; any warning fails it (a broken link, a page not in the nav, a public
# name without a docstring). Open site/index.html. `make test` builds it too (tests/test_docs_site.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site

# One lane, every serial test (the Slurm ones too), for a single run or a profile.
test-serial: $(STAMP)
	$(PYTHON) -m pytest -q --durations=15 tests --ignore=tests/mpi

# pytest-mpi: every rank runs pytest. Each rank's output goes to .pytest-rank<r>.log; rank 0's is shown,
# the others' only when the run fails.
test-mpi: $(STAMP)
	@rm -f .pytest-rank*.log
	@timeout --foreground 900 $(MPIRUN) -n $(MPI_TEST_RANKS) -outfile-pattern .pytest-rank%r.log -errfile-pattern .pytest-rank%r.log \
	  $(PYTHON) -m pytest -q -p no:cacheprovider --with-mpi --only-mpi tests/mpi; rc=$$?; cat .pytest-rank0.log; \
	  if [ $$rc -ne 0 ]; then for f in .pytest-rank*.log; do echo "== $$f"; tail -n 60 $$f; done; fi; exit $$rc

bench: $(STAMP)
	$(MPIRUN) -n 3 $(PYTHON) -m mpi_fnas.bench $(ARGS)

# The container image, with Charliecloud, from containers/Dockerfile (containers/mpi_fnas.def's steps, the same
# scripts/install.sh): 2.5 minutes and 1.5 GB here, so not part of `make test`; tests/test_image.py and the
# multi-node Slurm test run it once it exists. MPI_FNAS_TORCH=cuda builds the GPU image.
image:
	bash scripts/build_image.sh

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache .pytest-rank*.log .pytest-lane2.log
