"""Train the separate draft model (drafter="model") for the embedded target, distilled.

The draft model is the target cut short: its embedding (frozen, tied output), its first
--layers blocks and its final norm, then trained to match the target's next-token
distribution (soft cross-entropy over the kept vocabulary of train_mtp_head.py, labels
from the cached target hidden states in build/drafters/feats/). Seeded, resumable
(build/drafters/draft/), time-boxed; the best checkpoint by held-out loss is saved as an
ordinary mlx-lm llama folder (8-bit weights; specbatch loads it as fp32 on CPU) with the
target's tokenizer files.

    python -m specbatch.blas scripts/train_draft_model.py --minutes 22
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import drafter_common as dc  # noqa: E402
from train_mtp_head import is_val  # noqa: E402

OUT = dc.BUILD / "draft"


def target_folder() -> Path:
    from specbatch.kernels.gguf import cached_folder
    from specbatch.kernels.models import demo_pair
    return cached_folder(demo_pair()["target"], dequantize=False)


def draft_config(n_layers: int) -> dict:
    cfg = json.loads((target_folder() / "config.json").read_text())
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    cfg["num_hidden_layers"] = n_layers
    return cfg


def init_model(target, layers: list[int]) -> llama.Model:
    cfg = draft_config(len(layers))
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    src = target.model.model
    weights = {"model.embed_tokens.weight": src.embed_tokens.weight, "model.norm.weight": src.norm.weight}
    for i, j in enumerate(layers):
        for k, v in tree_flatten(src.layers[j].parameters()):
            weights[f"model.layers.{i}.{k}"] = v
    model.load_weights(list(weights.items()))
    model.freeze(keys=["embed_tokens"], recurse=True, strict=False)
    model.model.embed_tokens.freeze()
    mx.eval(model.parameters())
    return model


def batch_arrays(seqs: list[dict]):
    L = max(len(s["tokens"]) for s in seqs)
    tokens = np.zeros((len(seqs), L), dtype=np.int32)
    hidden = np.zeros((len(seqs), L, seqs[0]["hidden"].shape[-1]), dtype=np.float16)
    greedy = np.full((len(seqs), L), -1, dtype=np.int32)
    mask = np.zeros((len(seqs), L), dtype=bool)
    for i, s in enumerate(seqs):
        n = len(s["tokens"])
        tokens[i, :n], hidden[i, :n], greedy[i, :n], mask[i, :n] = s["tokens"], s["hidden"], s["greedy"], True
    return mx.array(tokens), mx.array(hidden).astype(mx.float32), mx.array(greedy), mx.array(mask)


def losses(model, W, batch):
    tokens, hidden, greedy, mask = batch
    h = model.model(tokens)  # [B, L, D], post-norm
    logp = nn.log_softmax(h @ W.T, axis=-1)
    p = mx.softmax(hidden @ W.T, axis=-1)
    m = mask.astype(mx.float32)
    ce = (-(p * logp).sum(-1) * m).sum()
    full = mx.argmax(model.model.embed_tokens.as_linear(h), axis=-1)  # the drafter's real proposal
    hit = ((full == greedy).astype(mx.float32) * m).sum()
    return ce, hit, m.sum()


def evaluate(model, W, seqs, bs=4) -> dict:
    tot = np.zeros(3)
    for i in range(0, len(seqs), bs):
        r = losses(model, W, batch_arrays(seqs[i:i + bs]))
        mx.eval(r)
        tot += [float(x) for x in r]
    return {"ce": round(tot[0] / tot[2], 4), "top1": round(tot[1] / tot[2], 4), "count": int(tot[2])}


def save_folder(model, out: Path, meta: dict | None = None) -> None:
    """An mlx-lm llama folder: the (frozen, tied) embedding 8-bit in groups of 32 as the
    target's GGUF ships it (so re-quantizing loses ~nothing), the blocks and norms fp16,
    the target's tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    q = llama.Model(model.args)
    q.load_weights(list(tree_flatten(model.parameters())))
    q.set_dtype(mx.float16)

    nn.quantize(q, group_size=32, bits=8, class_predicate=lambda path, m: path.endswith("embed_tokens"))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(q.parameters())), metadata={"format": "mlx"})
    cfg = draft_config(len(model.layers))
    cfg["quantization"] = {"group_size": 32, "bits": 8}  # mlx-lm quantizes only layers saved with scales
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (target_folder() / name).exists():
            shutil.copy(target_folder() / name, out / name)
    if meta is not None:
        (out / "training.json").write_text(json.dumps(meta, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=22.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen-repeat", type=int, default=2, help="times the target's own answers appear per epoch")
    ap.add_argument("--layers", default="0,1,2,3", help="target blocks the draft model starts from")
    ap.add_argument("--vocab", type=int, default=8192, help="kept vocabulary of the distillation loss")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-every", type=float, default=150.0)
    ap.add_argument("--feats", type=Path, default=dc.FEATS, help="feature chunks (a fused extraction's do too)")
    args = ap.parse_args()
    mx.random.seed(args.seed)
    target = dc.load_target()
    chunks = dc.load_chunks(folder=args.feats)
    train = dc.sequences_of([c for c in chunks if not is_val(c["name"])])
    val = dc.sequences_of([c for c in chunks if is_val(c["name"])])
    unique_tokens = int(sum(len(s["tokens"]) for s in train))
    train += [s for s in train if s["chunk"].startswith("gen")] * (args.gen_repeat - 1)  # in-distribution: seen more
    for s in train + val:  # the draft model needs no KV features
        s.pop("keys", None), s.pop("values", None), s.pop("layers", None)
    ntok = lambda ss: int(sum(len(s["tokens"]) for s in ss))  # noqa: E731
    print(f"train {ntok(train)} tokens, held-out {ntok(val)} tokens")
    order = np.load(dc.BUILD / "mtp" / "vocab_order.npy")
    vocab_ids = np.sort(order[:args.vocab])
    W = target.model.model.embed_tokens.weight[mx.array(vocab_ids)]
    layers = [int(x) for x in args.layers.split(",")]
    model = init_model(target, layers)
    del target
    OUT.mkdir(parents=True, exist_ok=True)
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    state = {"step": 0, "elapsed": 0.0, "best": None, "history": [], "tokens_seen": 0}
    if (OUT / "state.json").exists():
        state = json.loads((OUT / "state.json").read_text())
        model.load_weights(list(mx.load(str(OUT / "ckpt.safetensors")).items()), strict=False)
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(OUT / "opt.safetensors")).items()))
        print(f"resumed at step {state['step']}")
    if state["step"] == 0:
        ev = evaluate(model, W, val)
        print("init held-out", ev)
        state["history"].append({"step": 0, "minutes": 0.0, **ev})

    def loss_fn(batch):
        ce, _, cnt = losses(model, W, batch)
        return ce / cnt
    grad_fn = nn.value_and_grad(model, loss_fn)

    def save_state():
        mx.save_safetensors(str(OUT / "ckpt.safetensors"), dict(tree_flatten(model.trainable_parameters())))
        mx.save_safetensors(str(OUT / "opt.safetensors"), dict(tree_flatten(opt.state)))
        (OUT / "state.json").write_text(json.dumps(state))

    def check(ev):
        state["history"].append({"step": state["step"], "minutes": round(state["elapsed"] / 60, 2), **ev})
        tqdm.write(f"step {state['step']} held-out {ev}")
        if state["best"] is None or ev["ce"] < state["best"]["ce"]:
            state["best"] = {"step": state["step"], **ev}
            save_folder(model, OUT / "best")
        save_state()

    budget = args.minutes * 60
    rng = np.random.default_rng(args.seed + state["step"])
    t_start, last_eval = time.time() - state["elapsed"], time.time()
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), desc="draft train (s)", unit="s")
    for group, lr in dc.timed_batches(train, args.batch, rng, budget, t_start, args.lr, 30, state["step"]):
        opt.learning_rate = lr
        loss, grads = grad_fn(batch_arrays(group))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state, loss)
        state["step"] += 1
        state["tokens_seen"] += ntok(group)
        state["elapsed"] = time.time() - t_start
        bar.update(int(state["elapsed"]) - bar.n)
        bar.set_postfix(step=state["step"], loss=f"{float(loss):.3f}")
        if time.time() - last_eval > args.eval_every:
            last_eval = time.time()
            check(evaluate(model, W, val))
    bar.close()
    check(evaluate(model, W, val))
    dc.write_summary(OUT, state, args, unique_tokens, ntok(val), layers_from_target=layers, loss_vocab=args.vocab)


if __name__ == "__main__":
    main()
