"""Train the embedded demo pair: a small Python-code target and a drafter distilled from it.

Corpus: this interpreter's standard-library sources (present on every machine), split
into train / held-out by a hash of each file's path. Tokenizer: byte-level BPE trained
here. Both models are mlx-lm llama folders (config.json, model.safetensors, tokenizer).

Phases, each time-boxed and resumable from checkpoints under --work:
  1. target: next-token cross-entropy, AdamW, warmup + cosine, grad clip 1.0;
  2. drafter: cross-entropy mixed with KL to the target's logits (distillation), which
     is what raises greedy agreement, the number speculation lives on.

    python -m specbatch.blas scripts/train_demo_pair.py --target-minutes 90 --drafter-minutes 25
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from tqdm import tqdm

from specbatch.tiny import CHAT_TEMPLATE, SPECIALS  # one tokenizer convention for all our models

SHAPES = {
    "target": dict(hidden_size=384, num_hidden_layers=8, intermediate_size=1152,
                   num_attention_heads=6, num_key_value_heads=6),
    "drafter": dict(hidden_size=192, num_hidden_layers=2, intermediate_size=576,
                    num_attention_heads=3, num_key_value_heads=3),
}


def corpus_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held = [p for p in files if hashlib.sha1(str(p.relative_to(root)).encode()).digest()[0] < 5]
    train = [p for p in files if p not in set(held)]
    return train, held


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(train: list[Path], out: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(p) for p in train), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": None, "pad_token": "<|endoftext|>", "model_max_length": 2048,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    return tok


def encode(tok, files: list[Path]) -> np.ndarray:
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch([read(p) for p in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def model_args(role: str, vocab: int) -> dict:
    return dict(model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=True, max_position_embeddings=2048, **SHAPES[role])


def make_model(cfg: dict, seed: int) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    # N(0,1) embeddings with tied heads give logits of std ~sqrt(d): training crawls.
    emb = model.model.embed_tokens
    emb.weight = 0.02 * mx.random.normal(emb.weight.shape)
    mx.eval(model.parameters())
    return model


def batch_at(data: np.ndarray, step: int, seed: int, bsz: int, seq: int) -> mx.array:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=bsz)
    return mx.array(np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32))


def lr_at(step: int, frac: float, peak: float, warmup: int) -> float:
    """Linear warmup by step, then cosine to 10% over the *time* budget.

    Time, not steps: the machine is shared, so step rates vary and a step-sized
    schedule would end with the learning rate still high."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def save_ckpt(d: Path, model, opt, meta: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(d / "opt.safetensors"), dict(tree_flatten(opt.state)))
    (d / "meta.json").write_text(json.dumps(meta))


def load_ckpt(d: Path, model, opt) -> dict | None:
    if not (d / "meta.json").exists():
        return None
    model.load_weights(list(mx.load(str(d / "model.safetensors")).items()))
    opt.state = tree_unflatten(list(mx.load(str(d / "opt.safetensors")).items()))
    return json.loads((d / "meta.json").read_text())


def train_phase(role, model, loss_fn, data, args, minutes, work: Path, peak_lr):
    """Time-boxed training with a cosine schedule sized from measured step time."""
    opt = optim.AdamW(learning_rate=peak_lr, weight_decay=0.1)
    meta = load_ckpt(work / role, model, opt) or {"step": 0, "total": 0, "elapsed": 0.0}
    state = [model.state, opt.state]

    def step_fn(batch):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    step_fn = mx.compile(step_fn, inputs=state, outputs=state)
    budget = minutes * 60.0
    bar = tqdm(desc=role, unit="step", initial=meta["step"])
    last_save, t0, ema = time.time(), time.time() - meta["elapsed"], None
    while time.time() - t0 < budget:
        step = meta["step"]
        opt.learning_rate = lr_at(step, (time.time() - t0) / budget, peak_lr, args.warmup)
        loss = step_fn(batch_at(data, step, args.seed, args.batch, args.seq))
        mx.eval(state)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        meta["step"], meta["elapsed"] = step + 1, time.time() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{opt.learning_rate.item():.1e}")
        if time.time() - last_save > 300:
            save_ckpt(work / role, model, opt, meta)
            last_save = time.time()
    save_ckpt(work / role, model, opt, meta)
    bar.close()
    return meta


def timed_fit(model, opt, loss_and_grad, inputs_at, lr_at_step, minutes: float, desc: str) -> int:
    """The short fine-tunes' loop: ``loss_and_grad(model, *inputs_at(step))`` for ``minutes``,
    learning rate ``lr_at_step(step, elapsed fraction)``, grad clip 1.0; returns the steps."""
    t0, step, ema = time.time(), 0, None
    bar = tqdm(desc=desc, unit="step")
    while (elapsed := time.time() - t0) < minutes * 60:
        opt.learning_rate = lr_at_step(step, elapsed / (minutes * 60))
        loss, grads = loss_and_grad(model, *inputs_at(step))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    return step


def ce_loss(model, batch):
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def distill_loss_for(teacher):
    def loss(model, batch):
        logits = model(batch[:, :-1])
        t_logp = mx.stop_gradient(nn.log_softmax(teacher(batch[:, :-1]), axis=-1))
        s_logp = nn.log_softmax(logits, axis=-1)
        kl = (mx.exp(t_logp) * (t_logp - s_logp)).sum(-1).mean()
        ce = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")
        return 0.5 * ce + 0.5 * kl
    return loss


def evaluate(target, drafter, held: np.ndarray, n: int = 24, seq: int = 256) -> dict:
    """Held-out loss of both and teacher-forced greedy agreement (drafter vs target)."""
    losses = {"target": [], "drafter": []}
    agree = []
    for i in range(n):
        batch = batch_at(held, 10**6 + i, 0, 4, seq)
        lt, ld = target(batch[:, :-1]), drafter(batch[:, :-1])
        losses["target"].append(nn.losses.cross_entropy(lt, batch[:, 1:], reduction="mean").item())
        losses["drafter"].append(nn.losses.cross_entropy(ld, batch[:, 1:], reduction="mean").item())
        agree.append((lt.argmax(-1) == ld.argmax(-1)).astype(mx.float32).mean().item())
    return {"heldout_loss_target": float(np.mean(losses["target"])),
            "heldout_loss_drafter": float(np.mean(losses["drafter"])),
            "greedy_agreement_teacher_forced": float(np.mean(agree))}


def export(model, cfg: dict, tok_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16"}, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text((tok_dir / name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("build/train"))
    ap.add_argument("--out", type=Path, default=Path("src/specbatch/demo_models"))
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--target-minutes", type=float, default=90)
    ap.add_argument("--drafter-minutes", type=float, default=25)
    ap.add_argument("--target-lr", type=float, default=1e-3)
    ap.add_argument("--drafter-lr", type=float, default=2e-3)
    args = ap.parse_args()

    train_files, held_files = corpus_files()
    tok_dir = args.work / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    else:
        tok = build_tokenizer(train_files, tok_dir, args.vocab)
    cache = args.work / "tokens.npz"
    if cache.exists():
        z = np.load(cache)
        train, held = z["train"], z["held"]
    else:
        train, held = encode(tok, train_files), encode(tok, held_files)
        np.savez(cache, train=train, held=held)
    print(f"corpus: {len(train_files)} train files, {len(train):,} tokens; "
          f"{len(held_files)} held-out files, {len(held):,} tokens", flush=True)

    vocab = tok.get_vocab_size()
    cfgs = {role: model_args(role, vocab) for role in SHAPES}
    target = make_model(cfgs["target"], args.seed)
    tmeta = train_phase("target", target, ce_loss, train, args, args.target_minutes,
                        args.work, args.target_lr)
    drafter = make_model(cfgs["drafter"], args.seed + 1)
    target.freeze()
    dmeta = train_phase("drafter", drafter, distill_loss_for(target), train, args,
                        args.drafter_minutes, args.work, args.drafter_lr)
    report = {**evaluate(target, drafter, held), "target_steps": tmeta["step"],
              "drafter_steps": dmeta["step"], "tokens_per_step": args.batch * args.seq,
              "train_tokens": int(len(train)), "heldout_tokens": int(len(held))}
    print(json.dumps(report, indent=1), flush=True)
    export(target, cfgs["target"], tok_dir, args.out / "target")
    export(drafter, cfgs["drafter"], tok_dir, args.out / "drafter")
    (args.out / "training.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
