"""Shared by the drafter scripts: the target's features over token data, cached on disk.

A feature chunk (build/drafters/feats/<name>_NNNN.npz) holds a right-padded batch of
sequences that start at position 0: tokens [S, L], lengths [S], the target's final
post-norm hidden states [S, L, D] (what ``ModelRunner.hidden`` holds and the MTP drafter
feeds its head), its last-layer KV as the cache stores it (RoPE applied) [S, Hkv, L, d],
and its greedy token after each position [S, L]; asked for layers (an EAGLE-3-style head),
also those layers' outputs, concatenated [S, L, n * D] (``ModelRunner.keep_layers``; such
chunks go to their own folder, ``feats_folder``). Right padding never changes a valid
position under the causal mask. The forward is the runner's, on the fast CPU kernels.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "drafters"
DATA = BUILD / "data"
FEATS = BUILD / "feats"
EOS = 2  # <|im_end|>


def load_target(path=None):
    from specbatch.kernels.models import demo_pair, load
    return load(path or demo_pair()["target"])


def feats_folder(layers=(), base: Path = FEATS) -> Path:
    """Where features live: ``base``, or (with layer outputs) a folder named by the layers."""
    return base if not layers else base.with_name(f"{base.name}_l{'-'.join(map(str, layers))}")


def covered_by_turn2(path: Path) -> bool:
    """A first-turn chunk whose second turns are saved: each of its chat sequences is (up to
    re-encoding the answer) a prefix of a second turn's, so features for those cover it."""
    name = path.name
    return name.startswith("gen_") and not name.startswith(("gen_t", "gen_ts")) and \
        (path.parent / f"gen_t{name[4:]}").exists()


def generated_sequences(paths=None, max_len: int = 768, eos: int = EOS, data: Path = DATA) -> list[list[int]]:
    """Prompt + answer + EOS per generated row (a second turn's prompt holds the first chat);
    a first-turn chunk's chat rows are left to its second turns where those exist."""
    seqs = []
    for path in paths if paths is not None else sorted(data.glob("gen_*.json")):
        skip_chat = covered_by_turn2(path)
        for row in json.loads(path.read_text())["rows"]:
            if skip_chat and row["kind"] == "chat":
                continue
            ans = row["answer_ids"]
            seqs.append((row["prompt_ids"] + ans + [eos])[:max_len])
    return seqs


def text_sequences(data: Path = DATA) -> list[list[int]]:
    path = data / "text.npz"
    return [] if not path.exists() else np.load(path)["tokens"].tolist()


def batches(seqs: list[list[int]], max_tokens: int = 4096) -> list[list[list[int]]]:
    """Sequences grouped by length (sorted), at most max_tokens padded tokens a batch."""
    order = sorted(seqs, key=len)
    out, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out


def features(model, batch: list[list[int]], layers=()) -> dict:
    from specbatch.kernels.runner import ModelRunner
    L = max(len(s) for s in batch)
    tokens = np.zeros((len(batch), L), dtype=np.int32)
    for i, s in enumerate(batch):
        tokens[i, :len(s)] = s
    runner = ModelRunner(model)
    if layers:
        runner.keep_layers(layers)
    cache = runner.make_cache()
    greedy = mx.argmax(runner.forward(mx.array(tokens), cache), axis=-1).astype(mx.int32)  # [S, L]
    hidden = runner.hidden  # [S, L, D], post final norm
    keys, values = cache[-1].keys[..., :L, :], cache[-1].values[..., :L, :]
    out = {"hidden": hidden, "keys": keys, "values": values}
    if layers:  # pre final norm: a middle layer's outliers reach 2.5e4 (measured), clipped to fp16's range
        out["layers"] = mx.clip(runner.layer_hidden, -65000.0, 65000.0)  # [S, L, n * D]
    out = {k: v.astype(mx.float16) for k, v in out.items()}
    mx.eval(greedy, out)
    return {"tokens": tokens, "lengths": np.array([len(s) for s in batch], dtype=np.int32),
            "greedy": np.array(greedy), **{k: np.array(v) for k, v in out.items()}}


def extract(model, name: str, seqs: list[list[int]], deadline: float, max_tokens: int = 4096,
            folder: Path = FEATS, layers=()) -> int:
    """Cache features chunk by chunk (resumable: chunks on disk are skipped)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / f"{name}.captured").exists():  # drafter_data.py --capture wrote them
        return sum(len(s) for s in seqs)
    groups = batches(seqs, max_tokens)
    if name.startswith("text"):  # text chunks all have one length: spread the sources
        rng = np.random.default_rng(0)
        groups = [groups[i] for i in rng.permutation(len(groups))]
    done = 0
    bar = tqdm(total=sum(len(s) for g in groups for s in g), desc=f"features {name}", unit="tok")
    for i, group in enumerate(groups):
        path = folder / f"{name}_{i:04d}.npz"
        n = sum(len(s) for s in group)
        if path.exists():
            bar.update(n)
            done += n
            continue
        if time.time() > deadline:
            break
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **features(model, group, layers))
        tmp.replace(path)  # atomic: a killed run leaves no half chunk
        bar.update(n)
        done += n
    bar.close()
    return done


def load_chunks(names=("gen", "text"), folder: Path = FEATS) -> list[dict]:
    out = []
    for name in names:
        for path in sorted(folder.glob(f"{name}*_*.npz")):
            if path.name.endswith(".tmp.npz"):
                continue
            try:
                with np.load(path) as z:
                    out.append({k: z[k] for k in z.files} | {"name": path.stem})
            except (OSError, ValueError, EOFError):
                print(f"skipping unreadable {path}")
    return out


def sequences_of(chunks: list[dict]) -> list[dict]:
    """One dict per sequence (arrays cut to its length)."""
    seqs = []
    for c in chunks:
        for i, n in enumerate(c["lengths"]):
            seqs.append({"tokens": c["tokens"][i, :n], "hidden": c["hidden"][i, :n], "keys": c["keys"][i, :, :n],
                         "values": c["values"][i, :, :n], "greedy": c["greedy"][i, :n], "chunk": c["name"]}
                        | ({"layers": c["layers"][i, :n]} if "layers" in c else {}))
    return seqs


def accept_runs(ok: np.ndarray) -> np.ndarray:
    """ok [P, K] booleans (draft j right given 1..j-1 right) -> accepted tokens per start for k=1..K."""
    run = np.cumprod(ok, axis=1)  # [P, K]
    return np.stack([run[:, :k].sum(1) for k in range(1, ok.shape[1] + 1)], axis=1)


def heldout_prompts() -> dict:
    return json.loads((ROOT / "scripts" / "heldout_prompts.json").read_text())


def heldout_sequences(target, max_tokens: int = 160) -> list[dict]:
    """The target's greedy answers to the held-out prompts (cached): prompt + answer ids."""
    path = BUILD / "heldout_gen.json"
    if path.exists():
        return json.loads(path.read_text())
    from mlx_lm.generate import batch_generate
    tok = target.tokenizer
    held = heldout_prompts()
    items = [("chat", list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)))
             for p in held["chat"]] + [("code", list(tok.encode(p))) for p in held["code"]]
    res = batch_generate(target.model, tok, [p for _, p in items], max_tokens=max_tokens, return_token_ids=True)
    rows = [{"kind": k, "prompt_ids": p, "answer_ids": [int(t) for t in a]} for (k, p), a in zip(items, res.token_ids)]
    path.write_text(json.dumps(rows))
    return rows


def write_summary(out: Path, state: dict, args, unique_tokens: int, heldout_tokens: int, **extra) -> None:
    """The run's training.json beside its best checkpoint; the best result printed."""
    summary = {"steps": state["step"], "train_minutes": round(state["elapsed"] / 60, 2),
               "tokens_seen": state["tokens_seen"], "train_tokens_unique": unique_tokens,
               "gen_repeat": args.gen_repeat, "heldout_tokens": heldout_tokens, "lr": args.lr,
               "batch_seqs": args.batch, "seed": args.seed, **extra,
               "best": state["best"], "history": state["history"]}
    (out / "best" / "training.json").write_text(json.dumps(summary, indent=1))
    print("best", state["best"])


def length_batches(seqs: list[dict], bs: int, rng: np.random.Generator) -> list[list[dict]]:
    order = rng.permutation(len(seqs))
    out = []
    for i in range(0, len(order), 64 * bs):  # sort within windows: little padding, still shuffled
        win = sorted(order[i:i + 64 * bs], key=lambda j: len(seqs[j]["tokens"]))
        out += [[seqs[j] for j in win[k:k + bs]] for k in range(0, len(win), bs)]
    return [out[i] for i in rng.permutation(len(out))]


def timed_batches(seqs: list[dict], bs: int, rng: np.random.Generator, budget: float, t_start: float,
                  peak_lr: float, warmup: int, step: int):
    """(batch, learning rate) until ``budget`` seconds past ``t_start``: epochs of
    length-sorted batches; linear warm-up over ``warmup`` steps, then a cosine on elapsed
    time down to 10% of ``peak_lr`` (time-based, so a resumed run keeps its schedule)."""
    while True:
        groups = length_batches(seqs, bs, rng)
        if not groups:
            return
        for group in groups:
            elapsed = time.time() - t_start
            if elapsed >= budget:
                return
            warm = min(1.0, (step + 1) / warmup)
            yield group, peak_lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
            step += 1


def continue_from(previous: Path, out: Path) -> None:
    """A later stage (say, more unrolled steps) continues the previous run: its weights,
    optimizer state and clock. A fresh AdamW on the trained head diverged at once (NaN
    after one step, measured); the previous run's moments keep the first steps small.
    Its best is not carried over: the held-out score of a different unroll is not comparable."""
    import shutil
    out.mkdir(parents=True, exist_ok=True)
    for name in ("ckpt.safetensors", "opt.safetensors", "vocab_order.npy", "vocab_counts.npy"):
        shutil.copy(previous / name, out / name)
    state = json.loads((previous / "state.json").read_text())
    state["best"], state["continued_from"] = None, str(previous)
    (out / "state.json").write_text(json.dumps(state))
    print(f"continuing {previous} at step {state['step']}")


def vocab_order(out: Path, train_chunks: list[dict], data: Path, vocab_size: int, eos: int = EOS) -> np.ndarray:
    """Token ids most frequent first over the training data's greedy labels and the target's
    own answers (computed once per run folder, then read back)."""
    path = out / "vocab_order.npy"
    if not path.exists():
        counts = np.zeros(vocab_size, dtype=np.int64)
        for c in train_chunks:
            for i, L in enumerate(c["lengths"]):
                np.add.at(counts, c["greedy"][i, :L], 1)
        for gen in sorted(data.glob("gen_*.json")):
            for row in json.loads(gen.read_text())["rows"]:
                np.add.at(counts, np.array(row["answer_ids"] + [eos], dtype=np.int64), 1)
        np.save(path, np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32))
        np.save(out / "vocab_counts.npy", counts)
    return np.load(path)


def output_rows(target, vocab_ids: np.ndarray):
    """(input embedding [V, D], the kept output rows [N, D], position of each id in them or -1)."""
    model = target.model
    E = model.model.embed_tokens.weight
    W = (model.lm_head.weight if hasattr(model, "lm_head") else E)[mx.array(vocab_ids)]
    pos = np.full(int(model.args.vocab_size), -1, dtype=np.int32)
    pos[vocab_ids] = np.arange(len(vocab_ids))
    return E, W, mx.array(pos)
