# Two commands for a new user: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
HOST   ?= 127.0.0.1
PORT   ?= 8080
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## Run the gateway on 127.0.0.1:8080 (make run PORT=9000) in front of the built-in upstream simulator, data in ./data
run: $(STAMP)
	$(BIN)/codebuddy2api serve --simulator --host $(HOST) --port $(PORT) --data-dir ./data

## Install and run the whole test suite, on $(TEST_WORKERS) pytest-xdist workers (TEST_WORKERS=0: in one process)
TEST_WORKERS ?= 4
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

.PHONY: test-faults

## Real gateway processes under induced faults and attacks (store and upstream faults, SIGKILL,
## full disks, hostile sockets, /healthz under attack): minutes long, so not in `make test`
test-faults: $(STAMP)
	$(BIN)/python -m pytest -q -m faults

.PHONY: test-browser

## The WebUI (and a cross-site page) in real Chromium through Playwright (Debian's chromium:
## apt-get install chromium); not in `make test`
test-browser: $(STAMP)
	$(BIN)/python -m pytest -q -m browser

clean:
	rm -rf $(VENV) data .pytest_cache

.PHONY: test-recipes

## docs/clients.md's LangChain and Node recipes: installs those libraries into ~/.cache/codebuddy2api/recipes, runs tests/test_recipes.py
test-recipes: $(STAMP)
	PYTHON=$(PYTHON) bash .ci/recipes.sh
	CODEBUDDY2API_REQUIRE_RECIPES=1 $(BIN)/python -m pytest -q tests/test_recipes.py

.PHONY: bench bench-peer

## Benchmarks (not part of `make test`): gateway overhead vs the upstream and a raw relay -> docs/performance.md
bench: $(STAMP)
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null && test -x $(BIN)/py-spy || $(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/run.py

## The same harness with the LiteLLM proxy as one more target (installed into bench/.peer-venv only)
bench-peer: $(STAMP)
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null && test -x $(BIN)/py-spy || $(BIN)/pip install -q -e '.[bench]'
	PYTHON=$(PYTHON) sh bench/peer_install.sh
	$(BIN)/python bench/run.py --peer

.PHONY: test-clients

## The real agent CLIs (pinned Codex and Claude Code from npm, cached in ~/.cache/codebuddy2api/clients)
## against the gateway and the simulator, inside a loopback-only network namespace
test-clients: $(STAMP)
	bash scripts/install_clients.sh
	sh scripts/netns_run.sh env CODEBUDDY2API_CLIENTS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/clients

.PHONY: bench-malformed

## Hostile input: ~2,700 malformed bodies against a gateway + simulator (5xx, error shapes, upstream calls, RSS)
bench-malformed: $(STAMP)
	$(BIN)/python bench/malformed.py

.PHONY: llama-server test-real

## Build llama.cpp's llama-server and fetch SmolLM2-135M into ~/.cache/codebuddy2api/llama (once; ~15+ min)
llama-server:
	PYTHON=$(PYTHON) bash scripts/build-llama-server.sh

## Integration tests against the real llama-server (3 protocols x 2 modes); they skip without the build
test-real: $(STAMP)
	$(BIN)/python -m pytest -q -m real tests/test_real_llama.py

.PHONY: llama-cpp-python test-real-lcp

## Install llama-cpp-python's server (PyPI sdist, compiled) into ~/.cache/codebuddy2api/llama-cpp-python/venv (once; ~7+ min)
llama-cpp-python:
	PYTHON=$(PYTHON) bash scripts/build-llama-cpp-python.sh

## Integration tests against the real llama-cpp-python server (3 protocols x 2 modes, streamed and not); skip without the build
test-real-lcp: $(STAMP)
	$(BIN)/python -m pytest -q -m real tests/test_real_llama_cpp_python.py
