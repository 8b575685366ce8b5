"""Distil EAGLE-3-style MTP heads for the embedded target on an accelerator, in one time-boxed
run (PyTorch; the CPU recipe, `make drafters`, stays the reproducible default).

Inputs: the folder scripts/drafter_gpu_pack.py writes (the target's quantized arrays, token
data, the chat template's pieces, a reference forward). One run, in order:
1. the target, dequantized in fp32 and checked against the reference logits of this
   machine's MLX forward (the run stops if its argmax disagrees: a wrong port trains nothing);
2. data: questions the target writes itself after its chat template's pre-query prefix
   (Magpie: temperature 1, top-p 0.95), its greedy answers, answers sampled at 0.7, and a
   second user turn it writes after a greedy answer, answered greedily; beside the packed
   answers of earlier sessions. Time-boxed, in that order;
3. training: every variant (``--variants``) on the same batches, features computed on the fly
   by the frozen target (final hidden state, the fused layers' outputs, last-layer KV,
   greedy tokens), the head unrolled ``--unroll`` draft steps exactly as MTPHead.step chains
   them at run time (training-time test: step s reads its own step s-1 output); soft labels
   (the target's distribution over the kept vocabulary) or hard ones (its greedy token);
4. held-out: the target's greedy answers to scripts/heldout_prompts.json (never trained on),
   acceptance by draft position and tokens per round tau(k) for the shipped head and every
   variant, as scripts/measure_drafters.py computes them on the CPU.
Output (``--out``): ``<variant>.safetensors`` in MTPHead's own layout (fp16, the kept
vocabulary's ids beside the weights), ``report.json`` (configs, training history, held-out
figures), ``data.npz`` (the generated token data) and ``log.txt``.

    python3 scripts/drafter_gpu.py --pack .gpu --out "$OUT" --minutes 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from drafter_gpu_head import Head, length_batches, step_terms, to_batch
from drafter_gpu_target import EOS, Target, generate
from drafter_tally import summarize

NEWLINE = 198  # "\n"
CHAT_START = 1  # <|im_start|>: a sequence that does not begin with it is raw code
SPECIALS = 17  # ids below are the chat template's special tokens
FUSE = (2, 15, 29)
STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3)
LOG: list[str] = []


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    LOG.append(line)
    print(line, flush=True)


# ------------------------------------------------------------------------------------------- data

def write_questions(target, pieces, n: int, width: int, gen, deadline, seen: set) -> list[list[int]]:
    """Questions the target writes after its pre-query prefix (whole ones only, none twice)."""
    prefix = pieces["magpie_prefix"].tolist()
    qs: list[list[int]] = []
    while len(qs) < n and time.time() < deadline:
        for ids, ended in generate(target, [prefix] * width, 72, 1.0, 0.95, width, gen, deadline):
            key = tuple(ids)
            if ended and len(ids) >= 4 and min(ids) >= SPECIALS and key not in seen:
                seen.add(key)
                qs.append(ids)
    return qs[:n]


def code_prompts(target, seeds: list[list[int]], n: int, width: int, gen, deadline) -> list[list[int]]:
    """Raw code prompts the target writes itself: a seed ("def", "class", ...) continued at
    temperature 0.8 (top-p 0.95; at 1.0 a 135M model writes noise), cut after its second line
    (a signature and a docstring line, as the held-out code prompts are; no chat template)."""
    prompts = [seeds[i % len(seeds)] for i in range(n)]
    out = []
    for p, (ids, _) in zip(prompts, generate(target, prompts, 48, 0.8, 0.95, width, gen, deadline)):
        lines = [i for i, t in enumerate(ids) if t == NEWLINE]
        if len(lines) >= 2 and min(ids[:lines[1] + 1]) >= SPECIALS:
            out.append(p + ids[:lines[1] + 1])
    return out


def answered(target, prompts, args, temperature, gen, deadline, max_new=None) -> list[list[int]]:
    """prompt + answer (+ EOS where it ended) for each prompt that got an answer."""
    res = generate(target, prompts, max_new or args.max_new, temperature, 1.0, args.width, gen, deadline)
    return [p + a + ([EOS] if ended else []) for p, (a, ended) in zip(prompts, res) if a]


def make_data(target, pieces, args, deadline) -> dict:
    """New sequences (prompt + answer [+ EOS]) by kind, time-boxed, in the order of --phases:
    code (raw code prompts it writes, greedy continuations), greedy (its own questions,
    greedy answers), sampled (the same questions at 0.7), turn2 (a second user turn it writes
    after a greedy answer, answered greedily)."""
    gen = torch.Generator(device=target.device).manual_seed(args.seed)
    q_end, t2 = pieces["question_end"].tolist(), pieces["turn2_open"].tolist()
    prefix = pieces["magpie_prefix"].tolist()
    seen = {tuple(s) for s in pieces["held_questions"]}
    phases = args.phases.split(",")
    out = {name: [] for name in phases}
    prompts: list[list[int]] = []
    if {"greedy", "sampled", "turn2"} & set(phases):
        t0 = time.time()
        qs = write_questions(target, pieces, args.questions, args.width * 2, gen, deadline, seen)
        prompts = [prefix + q + q_end for q in qs]
        log(f"questions: {len(qs)} in {time.time() - t0:.0f} s")
    half = len(prompts) // 2
    for phase in phases:
        t0 = time.time()
        if phase == "code":
            seeds = unflat(pieces["code_seeds"], pieces["code_seeds_offsets"])
            starts = code_prompts(target, seeds, args.code, args.width * 2, gen, deadline)
            out[phase] = answered(target, starts, args, 0.0, gen, deadline, max_new=256)
            out[phase] += answered(target, starts[:len(starts) // 2], args, 0.7, gen, deadline, max_new=256)
        elif phase == "greedy":
            out[phase] = answered(target, prompts, args, 0.0, gen, deadline)
        elif phase == "sampled":
            out[phase] = answered(target, prompts[:half], args, 0.7, gen, deadline)
        elif phase == "turn2":
            # the answer's own EOS is the end of its turn, which the second turn's header begins with
            firsts = [s[:-1] + t2 if t2[0] == EOS else s + t2 for s in out.get("greedy", [])[half:]
                      if s[-1] == EOS and len(s) < args.max_len - 120]
            follow = generate(target, firsts, 72, 1.0, 0.95, args.width, gen, deadline)
            turns = [c + q + q_end for c, (q, ended) in zip(firsts, follow) if ended and len(q) >= 4 and min(q) >= SPECIALS]
            out[phase] = answered(target, turns, args, 0.0, gen, deadline)
        n_tok = sum(map(len, out[phase]))
        log(f"{phase}: {len(out[phase])} sequences ({n_tok:,} tokens with their prompts) in {time.time() - t0:.0f} s")
    return out



# ---------------------------------------------------------------------------------- evaluation

def accept(heads: dict, target: Target, seqs: list[list[int]], prompt_lens: list[int], kinds: list[str],
           K: int, keep, amp) -> dict:
    """Chain acceptance on the target's greedy answers, per head: acceptance per draft position
    (conditional on the earlier ones) and tau(k) = 1 + E[accepted], k = 1..K (as
    scripts/measure_drafters.py computes them)."""
    oks, ks = {name: [] for name in heads}, []
    for s, pl, kind in zip(seqs, prompt_lens, kinds):
        b = to_batch(target, [s], K, keep)
        L = len(s)
        n = np.arange(L - 1)
        greedy = b["greedy"][0].cpu().numpy()
        want = np.stack([greedy[n + j] for j in range(1, K + 1)], 1)
        gok = np.zeros(L + K + 1, bool)
        gok[1:L] = np.asarray(s[1:]) == greedy[:L - 1]
        sel = (n + 1 >= pl) & (n + K <= L - 1)
        ks += [kind] * int(sel.sum())
        for name, head in heads.items():
            W = target.E[head.vocab_ids]
            with torch.no_grad(), amp():
                outs = head.unrolled(target.E, b["tokens"], head.first(b), b["keys"], b["values"], K, target.rope)
                preds = torch.stack([head.vocab_ids[(h[0] @ W.T.to(h.dtype)).argmax(-1)] for h in outs], 1)  # [N, K]
            ok = preds.cpu().numpy() == want
            for j in range(2, K + 1):  # the chain continues on the target's greedy tokens only
                ok[:, j - 1:] &= gok[n + j][:, None]
            oks[name].append(ok[sel])
    return {name: summarize(np.concatenate(oks[name]), ks) for name in heads}


def validate(heads, target, val, S, keep, amp, budget) -> dict:
    sums = {name: np.zeros((S, 3)) for name in heads}
    for group in length_batches(val, budget, np.random.default_rng(0)):
        b = to_batch(target, group, S, keep)
        for name, (head, _) in heads.items():
            W, pos_of = head.out_rows
            with torch.no_grad(), amp():
                sums[name] += np.array([[float(t) for t in term] for term in step_terms(head, target, b, W, pos_of, S)])
    return {name: {"loss": (v[:, 0] / v[:, 2]).round(4).tolist(), "top1": (v[:, 1] / v[:, 2]).round(4).tolist()}
            for name, v in sums.items()}


# -------------------------------------------------------------------------------------- main

def check_port(target: Target, data) -> None:
    """fp32 logits and fused layers against this project's MLX forward (packed with the data)."""
    toks = torch.tensor(data["ref_tokens"].astype(np.int64), device=target.device)[None]
    hidden, layers, _ = target.forward(toks, keep=FUSE)
    logits = target.logits(hidden[0, -4:]).float().cpu().numpy()
    ref = data["ref_logits"]
    diff = float(np.abs(logits - ref).max())
    same = bool((logits.argmax(-1) == ref.argmax(-1)).all())
    ldiff = float(np.abs(layers[0, -4:].float().cpu().numpy() - data["ref_layers"]).max() / np.abs(data["ref_layers"]).max())
    log(f"port check (fp32): logits max |diff| {diff:.2e} (scale {np.abs(ref).max():.1f}), argmax equal {same}, "
        f"layers rel diff {ldiff:.2e}")
    if not same or diff > 1e-3 * np.abs(ref).max():
        raise SystemExit("the target's port disagrees with the reference forward: not training")


def unflat(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [flat[offsets[i]:offsets[i + 1]].astype(np.int64).tolist() for i in range(len(offsets) - 1)]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", type=Path, default=Path(".gpu"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="the whole run's time box")
    ap.add_argument("--gen-minutes", type=float, default=2.0, help="time box of the data phase")
    ap.add_argument("--eval-reserve", type=float, default=50.0, help="seconds kept for held-out evaluation and saving")
    ap.add_argument("--questions", type=int, default=8192)
    ap.add_argument("--code", type=int, default=4096, help="raw code prompts to write and continue")
    ap.add_argument("--code-repeat", type=int, default=1, help="times each raw-code sequence appears in the data")
    ap.add_argument("--phases", default="greedy,sampled,turn2", help="data phases in order (code,greedy,sampled,turn2)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="a previous run's --out: variants found there (<name>.safetensors) continue from its weights")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--extra-data", type=Path, nargs="*", default=[], help="earlier runs' data.npz, trained on too")
    ap.add_argument("--shipped", type=Path, default=Path("src/specbatch/demo_models/mtp"),
                    help="the head measured beside the new ones (skipped where absent)")
    ap.add_argument("--width", type=int, default=1024, help="rows per generation wave")
    ap.add_argument("--max-new", type=int, default=448)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--held-new", type=int, default=160, help="greedy tokens per held-out answer")
    ap.add_argument("--variants", default="fused-soft,plain-soft,fused-hard")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--unroll", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=float, default=90.0, help="seconds between checkpoints into --out")
    ap.add_argument("--limit-old", type=int, default=0, help="packed sequences used (0: all; a smoke test's cut)")
    return ap.parse_args()


def out_rows(target: Target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept output rows [N, D] and each token's position among them (-1: not kept) [V]."""
    pos = torch.full((target.V,), -1, dtype=torch.long, device=target.device)
    pos[ids] = torch.arange(len(ids), device=target.device)
    return target.E[ids], pos


def training_data(target: Target, data, pieces: dict, args, deadline: float, report: dict):
    """(train, val) sequences: the packed and earlier runs' data beside what this run writes."""
    new = make_data(target, pieces, args, deadline)
    old = unflat(data["train"], data["train_offsets"])
    if args.limit_old:
        old = old[:args.limit_old]
    for path in args.extra_data:  # an earlier run's generated data (its data.npz)
        with np.load(path) as z:
            for kind in [k for k in z.files if not k.endswith("_offsets")]:
                old += unflat(z[kind], z[f"{kind}_offsets"])
        log(f"with {path}: {len(old)} earlier sequences")
    seqs = [s[:args.max_len] for s in old + [seq for kind in new.values() for seq in kind]]
    seqs = [s for s in seqs if len(s) >= 8]
    seqs += [s for s in seqs if s[0] != CHAT_START] * (args.code_repeat - 1)  # raw code: rare in the chat data
    save_data(args.out / "data.npz", new)
    rng = np.random.default_rng(args.seed)
    val_idx = set(rng.choice(len(seqs), size=max(8, len(seqs) // 50), replace=False).tolist())
    val = [s for i, s in enumerate(seqs) if i in val_idx]
    train = [s for i, s in enumerate(seqs) if i not in val_idx]
    log(f"train {len(train)} seqs / {sum(map(len, train)):,} tokens; val {len(val)} seqs / {sum(map(len, val)):,}")
    report["data"] = {k: [len(v), int(sum(map(len, v)))] for k, v in new.items()} | {
        "packed": [len(old), int(sum(map(len, old)))], "train_tokens": int(sum(map(len, train)))}
    return train, val


def make_heads(target: Target, train: list[list[int]], args) -> dict:
    """Every variant, started from the target's last block (or --init-from's weights), with
    its optimizer. The kept vocabulary: the training data's most frequent tokens."""
    counts = np.bincount(np.concatenate([np.asarray(s, dtype=np.int64) for s in train]), minlength=target.V)
    vocab_ids = np.sort(np.lexsort((np.arange(target.V), -counts))[:args.vocab])
    sample = to_batch(target, train[:16], args.unroll, FUSE)
    final_rms = float(sample["hidden"][:, :64].float().pow(2).mean(-1).sqrt().mean())
    heads = {}
    for name in args.variants.split(","):
        head = Head(target, vocab_ids, FUSE if name.startswith("fused") else (), "soft" if name.endswith("soft") else "hard")
        head.init_last(target, final_rms)
        if args.init_from is not None and (args.init_from / f"{name}.safetensors").exists():
            head.load_mlx(args.init_from / f"{name}.safetensors")  # its weights and kept vocabulary
            log(f"{name}: continuing from {args.init_from}")
        head.out_rows = out_rows(target, head.vocab_ids)
        heads[name] = (head, torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95)))
    return heads


def checked_target(args, data) -> Target:
    """The target on this machine's accelerator, its port checked in fp32, then in bf16 there."""
    cuda = torch.cuda.is_available()
    if cuda:
        log(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    target = Target(args.pack, torch.device("cuda" if cuda else "cpu"), torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False  # the check compares fp32 with fp32
    check_port(target, data)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        target.set_dtype(torch.bfloat16)
    return target


def main() -> None:
    args = parse_args()
    t_start = time.time()
    end = t_start + args.minutes * 60
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else (lambda: torch.autocast("cpu", enabled=False))
    data = np.load(args.pack / "data.npz")
    target = checked_target(args, data)
    held = unflat(data["held"], data["held_offsets"])
    pieces = {k: data[k] for k in ("magpie_prefix", "question_end", "turn2_open", "code_seeds", "code_seeds_offsets")
              if k in data.files}
    q0, q1 = len(pieces["magpie_prefix"]), len(pieces["question_end"])
    pieces["held_questions"] = [h[q0:len(h) - q1] for h, code in zip(held, data["held_code"]) if not code]
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "log": LOG, "history": []}

    t0 = time.time()  # held-out answers first (small), then the training data
    answers = generate(target, held, args.held_new, 0.0, 1.0, len(held), torch.Generator(device=target.device), end)
    held_seqs = [h + a for h, (a, _) in zip(held, answers)]
    log(f"held-out answers: {sum(len(a) for a, _ in answers)} tokens in {time.time() - t0:.1f} s")
    train, val = training_data(target, data, pieces, args, min(end, time.time() + args.gen_minutes * 60), report)
    heads = make_heads(target, train, args)
    train_loop(heads, target, train, val, args, amp, end - args.eval_reserve, report)

    everyone = {}  # held-out acceptance, the shipped head beside the new ones
    if (args.shipped / "mtp_config.json").exists():
        everyone["shipped"] = Head.from_folder(target, args.shipped)
    everyone |= {n: h for n, (h, _) in heads.items()}
    kinds = ["code" if c else "chat" for c in data["held_code"]]
    report["heldout"] = accept(everyone, target, held_seqs, [len(h) for h in held], kinds, 5, FUSE, amp)
    for name, res in report["heldout"].items():
        log(f"held-out {name}: all {json.dumps(res['all'])}; chat tau {res['chat']['tau_by_k']}; "
            f"code tau {res['code']['tau_by_k']}")
    save_heads(heads, target, args, report)
    log(f"done in {time.time() - t_start:.0f} s")


def save_heads(heads, target, args, report) -> None:
    cfg = json.loads((args.pack / "target_config.json").read_text())
    report["configs"] = {}
    for name, (head, _) in heads.items():
        head.save_mlx(args.out / f"{name}.safetensors")
        report["configs"][name] = head.config(target, cfg.get("rope_theta", 10000.0), cfg.get("max_position_embeddings", 8192),
                                              target.layers[0]["gu"].shape[0] // 2)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    (args.out / "log.txt").write_text("\n".join(LOG) + "\n")


def save_data(path: Path, new: dict) -> None:
    arrays = {}
    for kind, seqs in new.items():
        if seqs:
            arrays[kind] = np.concatenate([np.asarray(s, dtype=np.uint16) for s in seqs])
            arrays[f"{kind}_offsets"] = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    np.savez_compressed(path, **arrays)
    log(f"saved new data: {path.stat().st_size / 2**20:.1f} MiB")


def train_loop(heads, target, train, val, args, amp, stop: float, report) -> None:
    """Every head on the same batches until ``stop``: linear warm-up, cosine on elapsed time."""
    S = args.unroll
    rng = np.random.default_rng(args.seed + 1)
    t0, last_save, step, tokens = time.time(), time.time(), 0, 0
    budget = max(1.0, stop - t0)
    running = {name: [] for name in heads}
    while time.time() < stop:
        for group in length_batches(train, args.batch_tokens, rng):
            el = time.time() - t0
            if time.time() >= stop:
                break
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, el / budget))))
            b = to_batch(target, group, S, FUSE)
            for name, (head, opt) in heads.items():
                W, pos_of = head.out_rows
                for g in opt.param_groups:
                    g["lr"] = lr
                with amp():
                    terms = step_terms(head, target, b, W, pos_of, S)
                    loss = sum(STEP_WEIGHTS[s] * t[0] / t[2].clamp(min=1.0) for s, t in enumerate(terms))
                if not torch.isfinite(loss):
                    continue
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                running[name].append(float(loss))
            step += 1
            tokens += sum(map(len, group))
            if step % 50 == 0 or time.time() - last_save > args.save_every:
                entry = {"step": step, "seconds": round(time.time() - t0, 1), "tokens": tokens,
                         "loss": {n: round(float(np.mean(r[-50:])), 4) for n, r in running.items() if r}}
                if time.time() - last_save > args.save_every:
                    entry["val"] = validate(heads, target, val, S, FUSE, amp, args.batch_tokens)
                    save_heads(heads, target, args, report)
                    last_save = time.time()
                report["history"].append(entry)
                log(json.dumps(entry))
    entry = {"step": step, "seconds": round(time.time() - t0, 1), "tokens": tokens,
             "val": validate(heads, target, val, S, FUSE, amp, args.batch_tokens)}
    report["history"].append(entry)
    log(json.dumps(entry))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        import traceback
        log(traceback.format_exc())
        raise
    finally:
        out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else None
        if out is not None and out.exists():
            (out / "log.txt").write_text("\n".join(LOG) + "\n")
