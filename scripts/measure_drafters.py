"""Measure the trained drafters on the held-out prompts (scripts/heldout_prompts.json).

Teacher-forced simulation against the target's greedy continuation at temperature 0:
for every starting point in the answers (pending token p), a chain of k drafts is
accepted up to its first disagreement with the target's greedy token. Reports acceptance
per draft position (conditional on the earlier ones), tokens per round tau(k) = 1 +
E[accepted] for k = 1..5, and each drafter's step time at batch 1.

    python -m specbatch.blas scripts/measure_drafters.py [--mtp DIR] [--draft DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import drafter_common as dc  # noqa: E402
import train_mtp_head as tm  # noqa: E402
from drafter_tally import summarize  # noqa: E402

K = 5


def held_features(target, layers=()):
    rows = dc.heldout_sequences(target)
    folder = dc.feats_folder(layers, dc.BUILD / "feats_heldout")  # a fused head's layers too
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in rows]
    feats = []
    for i, s in enumerate(seqs):  # one at a time: names stay tied to rows
        dc.extract(target.model, f"held{i:02d}", [s], time.time() + 3600, folder=folder, layers=layers)
    chunks = dc.load_chunks(names=[f"held{i:02d}" for i in range(len(seqs))], folder=folder)
    for r, c in zip(rows, chunks):
        s = dc.sequences_of([c])[0]
        s["prompt_len"], s["kind"] = len(r["prompt_ids"]), r["kind"]
        feats.append(s)
    return feats


def kept_ids(head, head_dir: Path, n: int | None) -> np.ndarray:
    """The ``n`` most frequent token ids by the training run's own order (beside its folder,
    else build/drafters/mtp's); the head's own kept set where ``n`` covers it or no order
    exists (a head trained elsewhere, such as by scripts/drafter_gpu.py)."""
    ids = np.array(head.vocab_ids)
    paths = [head_dir.parent / "vocab_order.npy", dc.BUILD / "mtp" / "vocab_order.npy"]
    order = next((np.load(p) for p in paths if p.exists()), None)
    if n is None or order is None or n == len(ids):
        return ids
    return np.sort(order[:n]).astype(np.int32)


def mtp_ok(target, head_dir: Path, feats, n_keep: int | None):
    from specbatch.kernels.drafters.mtp_checkpoint import load_head
    head = load_head(head_dir, target.model.args)
    if head.fuse_layers:  # its first step reads the target's layers: features that hold them
        feats = held_features(target, head.fuse_layers)
    ids = kept_ids(head, head_dir, n_keep if n_keep is not None and n_keep < len(head.vocab_ids) else None)
    E = target.model.model.embed_tokens.weight
    W = E[mx.array(ids)]
    idsm = mx.array(ids)
    oks, kinds = [], []
    for s in feats:
        b = tm.make_batch([s], K)
        first = head.first_input(b["layers"]) if head.fuse_layers else b["hidden"]
        outs = tm.unrolled(head, E, b["tokens"], first, b["keys"], b["values"], K)
        preds = mx.stack([idsm[mx.argmax(h[0] @ W.T, axis=-1)] for h in outs], axis=1)  # [N, K]
        N = preds.shape[0]
        n = np.arange(N)
        L = len(s["tokens"])
        greedy = np.concatenate([s["greedy"], np.full(K + 1, -2)])
        want = np.stack([greedy[n + j] for j in range(1, K + 1)], axis=1)
        ok = np.array(preds) == want
        path_ok = np.ones((N, K), bool)  # the chain continues on the target's greedy tokens only
        gok = np.zeros(L + K + 1, bool)
        gok[1:L] = s["tokens"][1:] == s["greedy"][:-1]
        for j in range(2, K + 1):
            path_ok[:, j - 1:] &= gok[n + j][:, None]
        sel = (n + 1 >= s["prompt_len"]) & (n + K <= L - 1)
        oks.append((ok & path_ok)[sel])
        kinds += [s["kind"]] * int(sel.sum())
    return np.concatenate(oks), kinds, head


def draft_ok(draft, feats):
    oks, kinds = [], []
    for s in feats:
        toks = mx.array(s["tokens"])[None]
        h = draft.model.model(toks)
        pred = np.array(mx.argmax(draft.model.model.embed_tokens.as_linear(h[0]), axis=-1))
        L = len(s["tokens"])
        n = np.arange(L - 1)
        pred = np.concatenate([pred, np.full(K + 1, -3)])
        greedy = np.concatenate([s["greedy"], np.full(K + 1, -2)])
        ok = np.stack([pred[n + j] == greedy[n + j] for j in range(1, K + 1)], axis=1)
        sel = (n + 1 >= s["prompt_len"]) & (n + K <= L - 1)
        oks.append(ok[sel])
        kinds += [s["kind"]] * int(sel.sum())
    return np.concatenate(oks), kinds


def median_ms(fn, reps=40) -> float:
    for _ in range(5):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return round(1000 * float(np.median(ts)), 2)


def step_times(target, head_dir: Path | None, draft, n_keeps=(4096, 8192)) -> dict:
    from specbatch.kernels.drafters.mtp import MTPDrafter
    from specbatch.kernels.drafters.mtp_checkpoint import load_head
    from specbatch.kernels.runner import ModelRunner, prefill
    runner = ModelRunner(target.model)
    ctx = list(range(1000, 1200))
    cache = runner.make_cache()
    prefill(runner, ctx, cache)
    out = {"target_step_ms": median_ms(lambda: _step(target.model, cache), reps=15)}
    if head_dir is not None:
        head = load_head(head_dir, target.model.args)
        full_ids = head.vocab_ids
        sets = {len(ids): ids for ids in (kept_ids(head, head_dir, n) for n in n_keeps)}  # one per size there is
        for n in list(sets) + [None]:
            if n is None:
                del head["vocab_ids"]
            else:
                head.vocab_ids = mx.array(sets[n])
            d = MTPDrafter(head, runner)
            d.hidden = mx.zeros((1, target.model.args.hidden_size))
            pending = mx.array([7])
            out[f"mtp_step_ms_{n or 'full'}"] = median_ms(
                lambda: d.draft(None, pending, 1, lambda lg, j: mx.argmax(lg, axis=-1), context=cache)[0])
        head.vocab_ids = full_ids
    if draft is not None:
        from mlx_lm.models.cache import KVCache
        dc_cache = [KVCache() for _ in draft.model.layers]
        draft.model(mx.array(ctx)[None], cache=dc_cache)
        mx.eval([c.keys for c in dc_cache])

        out["draft_model_step_ms"] = median_ms(lambda: _step(draft.model, dc_cache))
    return out


def _step(model, cache):
    """One decode step at batch 1 that leaves the cache at the same length."""
    logits = model(mx.array([[5]]), cache=cache)
    out = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(out)
    for c in cache:
        c.offset -= 1
    return out


def destination(tau: list[float], shipped: list[float] | None) -> str:
    """Where a measured MTP head goes: the default (``mtp``) only where its held-out tau at
    k = 3 or 4 clears 1.5 and beats the shipped head's, measured in the same run; else
    ``mtp-candidate``, beside it (a weaker head never replaces a stronger one)."""
    best = max(tau[2], tau[3])
    if best <= 1.5 or (shipped is not None and best <= max(shipped[2], shipped[3])):
        return "mtp-candidate"
    return "mtp"


def install(res: dict, mtp_dir: Path | None, draft_dir: Path | None, target) -> None:
    """Copy the measured drafters into the package. The MTP head goes where ``destination``
    says. Its kept vocabulary is the measured better of 4096/8192 (the smaller one on a tie
    within 0.01 tau: it is the cheaper step)."""
    import shutil

    from specbatch.kernels.drafters.mtp import save_head
    from specbatch.kernels.drafters.mtp_checkpoint import load_head
    from specbatch.kernels.models import DEMO_DIR
    if mtp_dir is not None:
        t4, t8 = res["mtp_top4096"]["all"]["tau_by_k"], res["mtp_top8192"]["all"]["tau_by_k"]
        n = 4096 if max(t4) >= max(t8) - 0.01 else 8192
        tau = res[f"mtp_top{n}"]["all"]["tau_by_k"]
        shipped = res.get("shipped_mtp", {}).get("all", {}).get("tau_by_k")
        good = destination(tau, shipped) == "mtp"
        out = DEMO_DIR / ("mtp" if good else "mtp-candidate")
        head = load_head(mtp_dir, target.model.args)  # before the folder goes: it may be the one measured
        shutil.rmtree(out, ignore_errors=True)
        head.vocab_ids = mx.array(kept_ids(head, mtp_dir, n))
        head.config["draft_vocab"] = int(head.vocab_ids.shape[0])
        save_head(head, out)
        meta = json.loads((mtp_dir / "training.json").read_text()) if (mtp_dir / "training.json").exists() else {}
        meta["heldout_measurement"] = {k: v for k, v in res.items() if k.startswith("mtp") or k in ("heldout", "step_times")}
        meta["installed_vocab"] = head.config["draft_vocab"]
        meta["default"] = good
        (out / "training.json").write_text(json.dumps(meta, indent=1))
        print(f"installed the MTP head (top-{n}) in {out}")
    if draft_dir is not None:
        out = DEMO_DIR / "drafter"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(draft_dir, out)
        meta = json.loads((draft_dir / "training.json").read_text())
        meta["heldout_measurement"] = {k: v for k, v in res.items() if k.startswith("draft") or k in ("heldout", "step_times")}
        (out / "training.json").write_text(json.dumps(meta, indent=1))
        print(f"installed the draft model in {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mtp", default=str(dc.BUILD / "mtp" / "best"))
    ap.add_argument("--draft", default=str(dc.BUILD / "draft" / "best"))
    ap.add_argument("--out", default=str(dc.BUILD / "measure.json"))
    ap.add_argument("--no-times", action="store_true")
    ap.add_argument("--install", action="store_true", help="copy the measured drafters into src/specbatch/demo_models")
    args = ap.parse_args()
    target = dc.load_target()
    feats = held_features(target)
    res = {"heldout": {"sequences": len(feats), "answer_tokens": int(sum(len(s["tokens"]) - s["prompt_len"] for s in feats))}}
    mtp_dir = Path(args.mtp) if Path(args.mtp, "mtp_config.json").exists() else None
    if mtp_dir is not None:
        for n in (4096, 8192):
            ok, kinds, _ = mtp_ok(target, mtp_dir, feats, n)
            res[f"mtp_top{n}"] = summarize(ok, kinds)
        from specbatch.kernels.models import DEMO_DIR
        shipped = DEMO_DIR / "mtp"
        if args.install and (shipped / "mtp_config.json").exists() and shipped.resolve() != mtp_dir.resolve():
            ok, kinds, _ = mtp_ok(target, shipped, feats, None)  # the head it would replace, same prompts
            res["shipped_mtp"] = summarize(ok, kinds)
    draft = None
    if Path(args.draft, "config.json").exists():
        from specbatch.kernels.models import load
        draft = load(args.draft)
        ok, kinds = draft_ok(draft, feats)
        res["draft_model"] = summarize(ok, kinds)
    if not args.no_times:
        res["step_times"] = step_times(target, mtp_dir, draft)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    if args.install:
        install(res, mtp_dir, Path(args.draft) if draft is not None else None, target)


if __name__ == "__main__":
    main()
