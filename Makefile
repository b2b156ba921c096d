VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: on these machines 2.13.0 is a local CPU wheel, while a bare
# `torch` or an open range would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# RL post-training on FSDP2 (tests/test_verl.py), without its dependencies: the ones
# its FSDP code imports are pinned in pyproject's dev extras.
VERL_PIN := verl==0.9.1

.PHONY: setup test test-fast demo bench bench-host gpu-check lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,demo]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(VERL_PIN)
	touch $@

test: setup
	$(PY) -m pytest -q --durations=20 tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not distributed"

# 2 CPU ranks on gloo, spawned by the script itself (no torchrun); output in runs/<timestamp>/.
demo: setup
	$(PY) scripts/train.py --nproc 2

# fsdp2 vs torch's fully_shard vs DDP vs the no-communication floor (2 gloo ranks,
# about a minute), then the hooks' CPU overhead (1 rank, 64 tiny groups), then Muon's
# optimizer step: fsdp2.optim.Muon vs torch.optim.Muon sharded and unsharded (seconds),
# then fsdp2 with each CompressionPolicy setting next to the others (about two minutes),
# then per-rank memory and bytes of FSDP, HSDP and HSDP with shard_optimizer_over_replicas
# (also compressed; 4 ranks), then a pipeline-parallel step (1F1B and ZBV on pp 2 x dp 2, fsdp2
# vs torch's fully_shard, about two minutes). Training quality of compression (300 steps per setting, ~15 min):
# scripts/bench_compression.py.
bench: setup
	$(PY) scripts/bench.py
	$(PY) scripts/bench_overhead.py
	$(PY) scripts/bench.py --optim muon
	$(PY) scripts/bench.py --compression weights-int8 grads-bf16 grads-int8 all-int8
	$(PY) scripts/bench_replicas.py
	$(PY) scripts/bench_pp.py
	$(PY) scripts/bench_import.py

# Host time with many parameter tensors (1k, 5k, 20k; 1 and 2 ranks): optimizer step,
# clipping, forward+backward and the whole step of plain / fsdp2 / torch's fully_shard,
# interleaved (several minutes); then every elementwise optimizer's step against plain
# tensors at 1k and 20k.
bench-host: setup
	$(PY) scripts/bench_host.py
	$(PY) scripts/bench_optim.py
	$(PY) scripts/bench_optim.py --params 20480

# On a CUDA machine: parity, overlap, memory and step time against torch's
# fully_shard (a few minutes, one table); without CUDA it says so and exits 0.
# On a machine with its own torch and no package index: make gpu-check PY=python3
# (no venv is made; fsdp2 runs from the checkout).
gpu-check:
	$(if $(filter $(VENV)/bin/python,$(PY)),@$(MAKE) --no-print-directory setup)
	$(PY) scripts/gpu_check.py

lint: setup
	$(VENV)/bin/ruff check fsdp2 tests scripts
	$(VENV)/bin/ruff format --check fsdp2 tests scripts
	$(VENV)/bin/mypy fsdp2 tests/typing_fully_shard.py

format: setup
	$(VENV)/bin/ruff check --fix fsdp2 tests scripts
	$(VENV)/bin/ruff format fsdp2 tests scripts

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
