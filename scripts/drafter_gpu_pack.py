"""Pack what scripts/drafter_gpu.py needs on an accelerator machine into .gpu/ (git-ignored).

The embedded target travels as its quantized arrays (MLX affine, group 32: 8-bit embedding,
4-bit linears), dequantized there, in two parts (each call to the device tool carries at
most 64 MiB, the working tree included): ``target_a.npz`` (embedding, final norm, layers
0..7) and ``target_b.npz`` (layers 8..29). ``data.npz`` holds token ids only: the
committed answers (data/drafters, prompt + answer + EOS), the chat template's pieces that
the GPU job needs to write and answer its own questions, the starts of raw code it continues, the held-out prompts (never
trained on) and a reference forward of the fp32 target on this machine (its logits) that
the job checks its port against before it spends any time.

    python -m specbatch.blas scripts/drafter_gpu_pack.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import drafter_common as dc  # noqa: E402
from drafter_prompts import HELDOUT  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".gpu"
SPLIT = 8  # layers below go with the embedding in part a
MARK = "XQZMARK"
CODE_SEEDS = ["import os\n\n\ndef", "import math\n\n\ndef", "from typing import List\n\n\ndef", "import re\n\n\ndef",
              "import json\n\n\ndef", "from collections import Counter\n\n\ndef", "import random\n\n\nclass",
              "from dataclasses import dataclass\n\n\n@dataclass\nclass", "import itertools\n\n\ndef",
              "import unittest\n\n\nclass"]  # raw code starts: a line of context, then a definition


def flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists as one uint16 array (the vocabulary has 49,152 ids) and their offsets [n + 1]."""
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    return np.concatenate([np.asarray(s, dtype=np.uint16) for s in seqs]), offsets


def template_pieces(tok) -> dict:
    """Token ids around a user turn: the pre-query prefix (system turn + user header), what
    follows a question (end of turn + assistant header) and what opens a second user turn."""
    one = tok.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=True, tokenize=False)
    before, after = one.split(MARK)
    two = tok.apply_chat_template([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "ANSWERMARK"},
                                   {"role": "user", "content": MARK}], add_generation_prompt=True, tokenize=False)
    between = two.split("ANSWERMARK")[1].split(MARK)[0]
    enc = lambda s: np.array(tok.encode(s, add_special_tokens=False), dtype=np.int32)  # noqa: E731
    seeds, seeds_off = flat([enc(w).tolist() for w in CODE_SEEDS])
    return {"magpie_prefix": enc(before), "question_end": enc(after), "turn2_open": enc(between),
            "code_seeds": seeds, "code_seeds_offsets": seeds_off}


def pack_target(folder: Path) -> None:
    weights = mx.load(str(folder / "model.safetensors"))
    parts = {"a": {}, "b": {}}
    for key, value in weights.items():
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
        parts["a" if layer < SPLIT else "b"][key] = np.array(value)
    for name, arrays in parts.items():
        np.savez(OUT / f"target_{name}.npz", **arrays)
    (OUT / "target_config.json").write_text((folder / "config.json").read_text())


def reference(target) -> dict:
    """The fp32 target's logits over a chat prompt on this machine (the port's check)."""
    from specbatch.kernels.runner import ModelRunner
    tok = target.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue? Answer briefly."}],
                                  add_generation_prompt=True, tokenize=True)
    runner = ModelRunner(target.model)
    runner.keep_layers((2, 15, 29))
    logits = runner.forward(mx.array(ids)[None], runner.make_cache())[0]  # [L, V]
    mx.eval(logits, runner.layer_hidden)
    return {"ref_tokens": np.array(ids, dtype=np.int32), "ref_logits": np.array(logits[-4:]),
            "ref_layers": np.array(runner.layer_hidden[0, -4:])}


def main() -> None:
    from specbatch.kernels.gguf import cached_folder
    from specbatch.kernels.models import demo_pair
    OUT.mkdir(exist_ok=True)
    pack_target(cached_folder(demo_pair()["target"], dequantize=False))
    target = dc.load_target()
    tok = target.tokenizer
    seqs = dc.generated_sequences(data=ROOT / "data" / "drafters")
    held = json.loads(HELDOUT.read_text())
    items = [("chat", list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=True))) for p in held["chat"]]
    items += [("code", list(tok.encode(p))) for p in held["code"]]
    train, train_off = flat(seqs)
    held_ids, held_off = flat([p for _, p in items])
    np.savez_compressed(OUT / "data.npz", train=train, train_offsets=train_off, held=held_ids, held_offsets=held_off,
             held_code=np.array([k == "code" for k, _ in items]), **template_pieces(tok), **reference(target))
    print(f"{len(seqs)} sequences, {len(train):,} tokens; {len(items)} held-out prompts -> {OUT}")
    for p in sorted(OUT.iterdir()):
        print(f"  {p.name}: {p.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
