"""Train the MTP head (drafter="mtp") for the embedded target on its own features.

1. Features: the frozen target runs over the token data of scripts/drafter_data.py (its
   own greedy answers first, then teacher-forced text) and caches, per position, its final
   post-norm hidden state (what ModelRunner.hidden holds and MTPDrafter feeds the head),
   its last-layer KV (RoPE applied, as the cache holds it) and its greedy next token
   (scripts/drafter_common.py; resumable chunks under build/drafters/feats/). With
   --fuse-layers (EAGLE-3-style input) it also caches those layers' outputs (under
   build/drafters/feats_l2-15-29/ for 2,15,29) and the head's first step reads
   fc([h_2; h_15; h_29]) in place of the final hidden state.
2. Training: the head is unrolled for --unroll draft steps exactly as at run time (step s
   reads its own step s-1 output hidden state, the target KV of positions < p and its own
   keys of this round). Step s at query n reads token n+s and is labelled with the target's
   distribution at position n+s (soft labels over the kept vocabulary); steps s >= 2 count
   only where tokens n+2..n+s are the target's greedy choices (the only paths a chain
   drafter continues on at temperature 0). The output is reduced to the --vocab most
   frequent tokens of the target's own output (vocab_ids, stored with the head).
   Seeded, resumable (build/drafters/mtp/), time-boxed; the best checkpoint by held-out
   (validation chunks) loss is kept in build/drafters/mtp/best/.

    python -m specbatch.blas scripts/train_mtp_head.py --extract-minutes 18 --minutes 30
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import drafter_common as dc  # noqa: E402

from specbatch.kernels.drafters.mtp import MTPHead, head_config, save_head  # noqa: E402

OUT = dc.BUILD / "mtp"
STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.5, 0.4)


def is_val(name: str) -> bool:
    """About one feature chunk in twelve is held out (by a hash of its name)."""
    return zlib.crc32(name.encode()) % 12 == 0


def init_head(target, vocab_ids: np.ndarray, init: str, seed: int, fuse=(), final_rms: float = 1.0) -> MTPHead:
    mx.random.seed(seed)
    cfg = head_config(target.model.args) | {"draft_vocab": int(len(vocab_ids))}
    if fuse:
        cfg["fuse_layers"] = [int(i) for i in fuse]
    head = MTPHead(cfg)
    if init == "last":  # the target's last block, reading [emb; hidden] summed
        last = dict(tree_flatten(target.model.model.layers[-1].parameters()))
        head.block.load_weights(list(last.items()))
        D = cfg["hidden_size"]
        head.eh_proj.weight = mx.concatenate([mx.eye(D), mx.eye(D)], axis=1) * 0.5
    else:  # random, the block's residual branches zeroed: it starts as a linear map of [emb; h]
        head.block.self_attn.o_proj.weight = mx.zeros_like(head.block.self_attn.o_proj.weight)
        head.block.mlp.down_proj.weight = mx.zeros_like(head.block.mlp.down_proj.weight)
    head.norm.weight = target.model.model.norm.weight
    if fuse:  # fc starts as the last fused layer alone, hnorm as the target's final norm over the
        # final state's mean RMS: step 1 then sees about what the plain head's hnorm(final) gives it
        D = cfg["hidden_size"]
        head.fc.weight = mx.concatenate([mx.zeros((D, (len(fuse) - 1) * D)), mx.eye(D)], axis=1)
        head.hnorm.weight = target.model.model.norm.weight / final_rms
    head.vocab_ids = mx.array(vocab_ids, dtype=mx.int32)
    mx.eval(head.parameters())
    return head


def unrolled(head: MTPHead, E: mx.array, tokens, first, keys, values, S: int) -> list[mx.array]:
    """Output hidden states [B, N, D] of draft steps 1..S for queries n = 0..N-1 (N = L-1);
    tokens padded to L + S; ``first`` [B, L + S, D]: step 1's input state (the final hidden,
    or a fused head's fc of the layers). Matches MTPHead.step chained as MTPDrafter.draft runs it."""
    attn = head.block.self_attn
    B, L = first.shape[0], keys.shape[2]
    N = L - 1
    ctx_k, ctx_v = keys[:, :, :N], values[:, :, :N]
    rows, cols = mx.arange(N)[:, None], mx.arange(N)[None]
    causal, diag = cols <= rows, cols == rows
    h = first[:, :N]
    own_k, own_v, outs = [], [], []
    for s in range(1, S + 1):
        x = head.eh_proj(mx.concatenate([head.enorm(E[tokens[:, s:s + N]]), head.hnorm(h)], axis=-1))
        a = head.block.input_layernorm(x)
        q = attn.q_proj(a).reshape(B, N, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(a).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(a).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = attn.rope(q, offset=s), attn.rope(k, offset=s)
        own_k.append(k)
        own_v.append(v)
        mask = mx.concatenate([causal] + [diag] * s, axis=1)
        out = mx.fast.scaled_dot_product_attention(q, mx.concatenate([ctx_k, *own_k], 2),
                                                   mx.concatenate([ctx_v, *own_v], 2), scale=attn.scale, mask=mask)
        x = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))
        x = x + head.block.mlp(head.block.post_attention_layernorm(x))
        h = head.norm(x)
        outs.append(h)
    return outs


def make_batch(seqs: list[dict], S: int) -> dict:
    L = max(len(s["tokens"]) for s in seqs)
    B = len(seqs)
    tokens = np.zeros((B, L + S), dtype=np.int32)
    hidden = np.zeros((B, L + S, seqs[0]["hidden"].shape[-1]), dtype=np.float16)
    hkv, d = seqs[0]["keys"].shape[0], seqs[0]["keys"].shape[-1]
    keys = np.zeros((B, hkv, L, d), dtype=np.float16)
    values = np.zeros_like(keys)
    greedy_ok = np.zeros((B, L + S), dtype=bool)  # token m is the target's greedy choice
    greedy = np.full((B, L + S), -1, dtype=np.int32)
    lengths = np.zeros(B, dtype=np.int32)
    for i, s in enumerate(seqs):
        n = len(s["tokens"])
        lengths[i] = n
        tokens[i, :n], hidden[i, :n], keys[i, :, :n], values[i, :, :n] = s["tokens"], s["hidden"], s["keys"], s["values"]
        greedy[i, :n] = s["greedy"]
        greedy_ok[i, 1:n] = s["tokens"][1:] == s["greedy"][:-1]
    extra = {}
    if "layers" in seqs[0]:  # a fused head's input: the target's kept layers [B, L + S, n * D]
        layers = np.zeros((B, L + S, seqs[0]["layers"].shape[-1]), dtype=np.float16)
        for i, s in enumerate(seqs):
            layers[i, :len(s["tokens"])] = s["layers"]
        extra["layers"] = mx.array(layers).astype(mx.float32)
    N = L - 1
    n = np.arange(N)[None]
    masks = []
    for step in range(1, S + 1):
        m = n + step <= lengths[:, None] - 1
        for j in range(2, step + 1):
            m = m & greedy_ok[:, j:j + N]
        masks.append(m)
    return {"tokens": mx.array(tokens), "hidden": mx.array(hidden).astype(mx.float32),
            "keys": mx.array(keys).astype(mx.float32), "values": mx.array(values).astype(mx.float32),
            "greedy": mx.array(greedy), "masks": [mx.array(m) for m in masks], **extra}


def step_losses(head, E, W, pos_of, batch, S):
    """Per-step (soft CE, top-1 hits, count) over the masked queries."""
    first = head.first_input(batch["layers"]) if head.fuse_layers else batch["hidden"]  # [B, L + S, D]
    outs = unrolled(head, E, batch["tokens"], first, batch["keys"], batch["values"], S)
    N = outs[0].shape[1]
    res = []
    for s, h in enumerate(outs, start=1):
        logp = nn.log_softmax(h @ W.T, axis=-1)
        p = mx.softmax(batch["hidden"][:, s:s + N] @ W.T, axis=-1)
        m = batch["masks"][s - 1].astype(mx.float32)
        ce = -(p * logp).sum(-1)
        want = pos_of[mx.maximum(batch["greedy"][:, s:s + N], 0)]  # -1: outside the kept set
        hit = (mx.argmax(logp, axis=-1) == want).astype(mx.float32)
        res.append(((ce * m).sum(), (hit * m).sum(), m.sum()))
    return res


def loss_fn(head, E, W, pos_of, batch, S):
    total = 0.0
    for s, (ce, _, cnt) in enumerate(step_losses(head, E, W, pos_of, batch, S)):
        total = total + STEP_WEIGHTS[s] * ce / mx.maximum(cnt, 1.0)
    return total


def evaluate(head, E, W, pos_of, seqs, S, bs=4) -> dict:
    sums = np.zeros((S, 3))
    for i in range(0, len(seqs), bs):
        res = step_losses(head, E, W, pos_of, make_batch(seqs[i:i + bs], S), S)
        mx.eval(res)
        sums += np.array([[float(a), float(b), float(c)] for a, b, c in res])
    return {"ce": (sums[:, 0] / sums[:, 2]).round(4).tolist(), "top1": (sums[:, 1] / sums[:, 2]).round(4).tolist(),
            "count": sums[:, 2].astype(int).tolist()}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extract-minutes", type=float, default=18.0)
    ap.add_argument("--minutes", type=float, default=30.0, help="training time box")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen-repeat", type=int, default=2, help="times the target's own answers appear per epoch")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--init", choices=["last", "random"], default="last",
                    help="last: the target's last block (measured: held-out top-1 0.43 after 500 steps vs 0.19)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue this run's weights and optimizer (a second stage, e.g. more unrolled steps); "
                         "--minutes counts from its clock")
    ap.add_argument("--fuse-layers", default="", help="EAGLE-3-style input: target layers fused, e.g. 2,15,29")
    ap.add_argument("--eval-every", type=float, default=120.0, help="seconds between held-out evaluations")
    ap.add_argument("--out", type=Path, default=dc.BUILD / "mtp", help="checkpoints, state and the best head")
    ap.add_argument("--data", type=Path, default=dc.DATA, help="scripts/drafter_data.py's output")
    ap.add_argument("--feats", type=Path, default=dc.FEATS, help="feature chunks (a fused run: <feats>_l<layers>)")
    ap.add_argument("--target", default=None, help="the target (default: the embedded one)")
    ap.add_argument("--max-len", type=int, default=768, help="tokens kept per generated chat")
    ap.add_argument("--text-tokens", type=int, default=None, help="teacher-forced text tokens to featurize (default: all)")
    ap.add_argument("--extract-only", choices=["gen", "text", "all"], help="cache features and stop")
    args = ap.parse_args()
    args.fuse = tuple(int(i) for i in args.fuse_layers.split(",") if i.strip())
    args.feats = dc.feats_folder(args.fuse, args.feats)
    return args


def cache_features(target, args) -> None:
    """One feature set per generation chunk, then the text (resumable, within --extract-minutes)."""
    deadline, eos = time.time() + args.extract_minutes * 60, target.tokenizer.eos_token_id
    if args.extract_only != "text":
        for path in sorted(args.data.glob("gen_*.json")):
            seqs = dc.generated_sequences([path], args.max_len, eos)
            dc.extract(target.model, f"gen{path.stem[4:]}", seqs, deadline, folder=args.feats, layers=args.fuse)
    if args.extract_only != "gen":
        text = dc.text_sequences(args.data)
        text = text[:args.text_tokens // max(1, len(text[0]))] if text and args.text_tokens else text  # RAM: 5.4 KB a fused token
        dc.extract(target.model, "text", text, deadline, folder=args.feats, layers=args.fuse)


def best_kept(head, state, ev, out: Path) -> None:
    """Record an evaluation; a better held-out score saves the head as the best."""
    state["history"].append({"step": state["step"], "minutes": round(state["elapsed"] / 60, 2), **ev})
    score = sum(w * c for w, c in zip(STEP_WEIGHTS, ev["ce"]))
    if math.isfinite(score) and (state["best"] is None or score < state["best"]["score"]):
        state["best"] = {"score": score, "step": state["step"], **ev}
        save_head(head, out / "best")


def train(head, opt, state, train_seqs, val, maps, args, out: Path) -> None:
    """Time-boxed steps from ``state`` (resumed where it stopped), evaluations every --eval-every s."""
    E, W, pos_of = maps
    S = args.unroll
    grad_fn = nn.value_and_grad(head, lambda b: loss_fn(head, E, W, pos_of, b, S))
    budget = args.minutes * 60
    rng = np.random.default_rng(args.seed + state["step"])
    t_start, last_eval = time.time() - state["elapsed"], time.time()
    bar = tqdm(total=int(budget), initial=int(state["elapsed"]), desc="mtp train (s)", unit="s")

    def save_state():
        mx.save_safetensors(str(out / "ckpt.safetensors"), dict(tree_flatten(head.parameters())))
        mx.save_safetensors(str(out / "opt.safetensors"), dict(tree_flatten(opt.state)))
        (out / "state.json").write_text(json.dumps(state))

    for group, lr in dc.timed_batches(train_seqs, args.batch, rng, budget, t_start, args.lr, 50, state["step"]):
        opt.learning_rate = lr
        loss, grads = grad_fn(make_batch(group, S))
        mx.eval(loss)
        if not math.isfinite(float(loss)):  # a diverging batch must not poison the weights
            state["skipped"] = state.get("skipped", 0) + 1
            continue
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        state["step"] += 1
        state["tokens_seen"] += int(sum(len(s["tokens"]) for s in group))
        state["elapsed"] = time.time() - t_start
        bar.update(int(state["elapsed"]) - bar.n)
        bar.set_postfix(step=state["step"], loss=f"{float(loss):.3f}")
        if time.time() - last_eval > args.eval_every:
            last_eval = time.time()
            ev = evaluate(head, E, W, pos_of, val, S)
            tqdm.write(f"step {state['step']} held-out ce {ev['ce']} top1 {ev['top1']}")
            best_kept(head, state, ev, out)
            save_state()
    bar.close()
    best_kept(head, state, evaluate(head, E, W, pos_of, val, S), out)
    save_state()


def main() -> None:
    args = parse_args()
    out = args.out
    target = dc.load_target(args.target)
    cache_features(target, args)
    if args.extract_only:
        return
    chunks = dc.load_chunks(folder=args.feats)
    train_chunks = [c for c in chunks if not is_val(c["name"])]
    train_seqs, val = dc.sequences_of(train_chunks), dc.sequences_of([c for c in chunks if is_val(c["name"])])
    if not val:  # too few chunks for one to be held out (a tiny run): score on the training data
        val = train_seqs[:8]
    unique_tokens = int(sum(len(s["tokens"]) for s in train_seqs))
    train_seqs += [s for s in train_seqs if s["chunk"].startswith("gen")] * (args.gen_repeat - 1)  # in-distribution: seen more
    ntok = lambda ss: int(sum(len(s["tokens"]) for s in ss))  # noqa: E731
    print(f"train {len(train_seqs)} seqs / {ntok(train_seqs)} tokens; held-out {len(val)} seqs / {ntok(val)} tokens")
    if args.init_from is not None and not (out / "state.json").exists():
        dc.continue_from(args.init_from, out)
    out.mkdir(parents=True, exist_ok=True)
    order = dc.vocab_order(out, train_chunks, args.data, int(target.model.args.vocab_size), target.tokenizer.eos_token_id)
    vocab_ids = np.sort(order[:args.vocab]).astype(np.int32)
    maps = dc.output_rows(target, vocab_ids)
    sample = np.concatenate([s["hidden"][:64] for s in train_seqs[:64]]).astype(np.float32)  # [n, D]
    final_rms = float(np.sqrt((sample ** 2).mean(-1)).mean())
    head = init_head(target, vocab_ids, args.init, args.seed, args.fuse, final_rms)
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.01)
    state = {"step": 0, "elapsed": 0.0, "best": None, "history": [], "tokens_seen": 0}
    if (out / "state.json").exists():
        state = json.loads((out / "state.json").read_text())
        head.load_weights(list(mx.load(str(out / "ckpt.safetensors")).items()))
        opt.init(head.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(out / "opt.safetensors")).items()))
        print(f"resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min)")
    if state["step"] == 0:
        ev = evaluate(head, *maps, val, args.unroll)
        print("init held-out", ev)
        state["history"].append({"step": 0, "minutes": 0.0, **ev})
    train(head, opt, state, train_seqs, val, maps, args, out)
    dc.write_summary(out, state, args, unique_tokens, ntok(val), vocab=args.vocab, unroll=args.unroll, init=args.init,
                     fuse_layers=list(args.fuse))


if __name__ == "__main__":
    main()
