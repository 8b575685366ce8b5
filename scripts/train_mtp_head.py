"""Train a multi-token-prediction head for a (frozen) target: a few minutes on 2 cores.

The head learns to predict token ``i + 2`` from the target's hidden state at ``i`` and
the embedding of token ``i + 1``, attending over the target's own last-layer KV: the
loss mixes KL to the target's distribution at ``i + 1`` (agreement is what speculation
needs) with cross-entropy on the data. Seeded; resumable is not needed at this size.

    python -m specbatch.blas scripts/train_mtp_head.py --target src/specbatch/demo_models/target \
        --out src/specbatch/demo_models/mtp --minutes 5
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

sys.path.insert(0, str(Path(__file__).parent))
from self_distill import gen_batch  # noqa: E402
from train_demo_pair import batch_at, corpus_files, encode, timed_fit  # noqa: E402

from specbatch.drafters.mtp import MTPHead, head_config, save_head  # noqa: E402
from specbatch.models import load  # noqa: E402
from specbatch.runner import ModelRunner  # noqa: E402


def target_pass(runner: ModelRunner, model, batch):
    """Frozen target over a batch: hidden [B, T, D], last-layer K/V, logits."""
    cache = model.make_cache()
    logits = runner.forward(batch, cache)
    n = batch.shape[1]
    return (mx.stop_gradient(runner.hidden), mx.stop_gradient(cache[-1].keys[..., :n, :]),
            mx.stop_gradient(cache[-1].values[..., :n, :]), mx.stop_gradient(logits))


def head_loss(head, runner, batch, hidden, keys, values, logits):
    # position i+1 queries: hidden from i, token i+1, target KV 0..i; predicts token i+2
    out = head.train_forward(hidden[:, :-2], runner.embed(batch[:, 1:-1]), keys[..., :-2, :], values[..., :-2, :])
    student = nn.log_softmax(runner.head(out), axis=-1)  # [B, T-2, V]
    teacher = nn.log_softmax(logits[:, 1:-1], axis=-1)
    kl = (mx.exp(teacher) * (teacher - student)).sum(-1).mean()
    ce = nn.losses.cross_entropy(runner.head(out), batch[:, 2:], reduction="mean")
    return 0.7 * kl + 0.3 * ce


def evaluate(head, runner, model, held, n=16) -> dict:
    agree, losses = [], []
    for i in range(n):
        batch = batch_at(held, 10**6 + i, 0, 4, 128)
        hidden, keys, values, logits = target_pass(runner, model, batch)
        out = head.train_forward(hidden[:, :-2], runner.embed(batch[:, 1:-1]), keys[..., :-2, :], values[..., :-2, :])
        pred = runner.head(out)
        agree.append((pred.argmax(-1) == logits[:, 1:-1].argmax(-1)).astype(mx.float32).mean().item())
        losses.append(nn.losses.cross_entropy(pred, batch[:, 2:], reduction="mean").item())
    return {"mtp_heldout_loss": float(np.mean(losses)), "mtp_greedy_agreement_teacher_forced": float(np.mean(agree))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, default=Path("build/train/tokens.npz"), help="cached corpus ids")
    ap.add_argument("--minutes", type=float, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generations", type=Path, default=None,
                    help="the target's own continuations (scripts/self_distill.py): half of each batch")
    args = ap.parse_args()

    target = load(args.target)
    model, runner = target.model, ModelRunner(target.model)
    model.freeze()
    if args.tokens.exists():
        z = np.load(args.tokens)
        train, held = z["train"], z["held"]
    else:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
        train_files, held_files = corpus_files()
        train, held = encode(tok, train_files), encode(tok, held_files)
    gens = np.load(args.generations)["train"] if args.generations else None
    mx.random.seed(args.seed)
    head = MTPHead(head_config(model.args))
    mx.eval(head.parameters())
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    loss_grad = nn.value_and_grad(head, lambda h, *a: head_loss(h, runner, *a))

    def inputs_at(step):
        batch = batch_at(train, step, args.seed + 7, args.batch, args.seq)
        if gens is not None:  # what the head will draft on: the target's text
            batch = mx.concatenate([batch[: args.batch // 2, : gens.shape[1]],
                                    gen_batch(gens, step, args.seed, args.batch - args.batch // 2)], axis=0)
        return (batch, *target_pass(runner, model, batch))

    def lr(step, frac):  # warmup, then linear decay to 10%
        return args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - frac))

    step = timed_fit(head, opt, loss_grad, inputs_at, lr, args.minutes, "mtp head")
    report = {**evaluate(head, runner, model, held), "mtp_steps": step, "mtp_minutes": args.minutes}
    print(json.dumps(report, indent=1))
    save_head(head, args.out)
    (args.out / "training.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
