"""Self-distillation of the drafter on the target's own generations.

Teacher-forced agreement on corpus text is not what speculation runs on: at serving time
the drafter must follow the *target's* text, with its habits (greedy loops included).
This generates continuations with the target (greedy and sampled, seeded, through the
engine's plain batch loop), then fine-tunes the drafter on a mix of those and corpus
text, with cross-entropy plus KL to the target's logits. Resumable: the generations are
cached under --work; the fine-tune is time-boxed.

    python -m specbatch.blas scripts/self_distill.py --pair src/specbatch/demo_models \
        --tokens build/train/tokens.npz --work build/self-distill --minutes 15
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm  # the generation's progress bar

sys.path.insert(0, str(Path(__file__).parent))
from train_demo_pair import batch_at, distill_loss_for, timed_fit  # noqa: E402

from specbatch import Engine, SamplingParams  # noqa: E402
from specbatch.config import EngineConfig  # noqa: E402
from specbatch.models import load  # noqa: E402


def generate(target, corpus: np.ndarray, n: int, prompt_len: int, new: int, seed: int) -> np.ndarray:
    """``n`` rows of [prompt, continuation]: even rows greedy, odd rows at T=0.7. [n, L]"""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - prompt_len, size=n)
    prompts = [corpus[s:s + prompt_len].astype(int).tolist() for s in starts]
    rows = []
    with Engine(target, None, EngineConfig(speculation=False, max_batch=16, prompt_cache_bytes=0)) as engine:
        for i in tqdm(range(0, n, 16), desc="generate", unit="batch"):
            handles = [engine.submit(p, SamplingParams(max_tokens=new, ignore_eos=True, seed=seed + i + j,
                                                       temperature=0.0 if (i + j) % 2 == 0 else 0.7))
                       for j, p in enumerate(prompts[i:i + 16])]
            rows += [p + h.result(timeout=3600).token_ids for p, h in zip(prompts[i:i + 16], handles)]
    return np.asarray(rows, dtype=np.uint16)


def gen_batch(gens: np.ndarray, step: int, seed: int, bsz: int) -> mx.array:
    rng = np.random.default_rng([seed, step, 1])
    return mx.array(gens[rng.integers(0, len(gens), size=bsz)].astype(np.int32))


def agreement(target, drafter, batch: mx.array, skip: int) -> float:
    """Teacher-forced greedy agreement on ``batch`` from position ``skip`` on."""
    lt, ld = target(batch[:, :-1])[:, skip:], drafter(batch[:, :-1])[:, skip:]
    return (lt.argmax(-1) == ld.argmax(-1)).astype(mx.float32).mean().item()


def finetune(target, drafter, corpus, gens, args) -> int:
    n_gen = args.batch * 3 // 4  # mostly the target's own text; corpus text keeps it general

    def inputs_at(step):
        g = gen_batch(gens, step, args.seed, n_gen)
        c = batch_at(corpus, step, args.seed + 3, args.batch - n_gen, g.shape[1] - 1)
        return (mx.concatenate([g, c], axis=0),)

    def lr(step, frac):  # warmup, then cosine to 10%
        return args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac)))

    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.1)
    return timed_fit(drafter, opt, nn.value_and_grad(drafter, distill_loss_for(target)), inputs_at, lr,
                     args.minutes, "self-distill")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, default=Path("src/specbatch/demo_models"))
    ap.add_argument("--tokens", type=Path, default=Path("build/train/tokens.npz"))
    ap.add_argument("--work", type=Path, default=Path("build/self-distill"))
    ap.add_argument("--sequences", type=int, default=768)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--minutes", type=float, default=15)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    target, drafter = load(args.pair / "target"), load(args.pair / "drafter")
    z = np.load(args.tokens)
    args.work.mkdir(parents=True, exist_ok=True)
    cache = args.work / "generations.npz"
    if cache.exists():
        gens, held = np.load(cache)["train"], np.load(cache)["held"]
    else:
        gens = generate(target, z["train"], args.sequences, args.prompt_len, args.new, args.seed)
        held = generate(target, z["held"], 32, args.prompt_len, args.new, args.seed + 10**6)
        np.savez(cache, train=gens, held=held)
    target.model.freeze()
    held_gen = mx.array(held[::2].astype(np.int32))  # the greedy rows: what T=0 serving sees
    held_corpus = batch_at(z["held"], 10**6, 0, 16, 128)
    before = {"gen": agreement(target.model, drafter.model, held_gen, args.prompt_len),
              "corpus": agreement(target.model, drafter.model, held_corpus, 0)}
    steps = finetune(target.model, drafter.model, z["train"], gens, args)
    after = {"gen": agreement(target.model, drafter.model, held_gen, args.prompt_len),
             "corpus": agreement(target.model, drafter.model, held_corpus, 0)}
    report = {"self_distill_steps": steps, "self_distill_minutes": args.minutes,
              "agreement_on_target_greedy_before": before["gen"], "agreement_on_target_greedy_after": after["gen"],
              "agreement_heldout_corpus_before": before["corpus"], "agreement_heldout_corpus_after": after["corpus"]}
    print(json.dumps(report, indent=1))
    weights = {k: v.astype(mx.float16) for k, v in __import__("mlx.utils").utils.tree_flatten(drafter.model.parameters())}
    mx.save_safetensors(str(args.pair / "drafter" / "model.safetensors"), weights, metadata={"format": "mlx"})
    path = args.pair / "training.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **report}, indent=1))


if __name__ == "__main__":
    main()
