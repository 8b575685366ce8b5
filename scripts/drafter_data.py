"""Token data for training drafters of the embedded target (SmolLM2-135M-Instruct).

Writes to build/drafters/data/ (resumable: a chunk already saved is skipped; time-boxed):
- text.npz: teacher-forcing text present on every machine (the Python standard library's
  sources, Debian's plain-text docs under /usr/share/doc, .gz decompressed), tokenized
  and cut into sequences of --seq tokens;
- magpie.json (then magpie_1.json, ... where a later run asks for more): user questions the
  target writes itself (Magpie: sample the user turn after the chat template's pre-query
  prefix at temperature 1), filtered, never one twice. Templates x topics
  (scripts/drafter_prompts.py) cover few shapes of question; these cover the target's own
  spread of them. scripts/heldout_prompts.json is never trained on;
- gen_*.json: the target's own answers, per prompt chunk (templated and self-written
  chunks alternate, so a time box keeps both) four files: greedy (gen_NNNN / gen_mNNNN),
  sampled at --temperature with a seed per row (gen_s*), and a second user turn (a
  templated follow-up) after each of those chat answers, answered the same way (gen_t*, gen_ts*).

Answers come from the project's own plain batch loop (BatchLoop over ModelRunner: the fast
CPU kernels that ``models.load`` swaps in, paged KV), --width rows at once, a finished row's
slot refilled from the chunk (continuous batching); a seeded row samples the same tokens at
any width. ``--capture`` (scripts/drafter_capture.py) writes each chunk's features from the
decode forwards themselves (with ``--fuse-layers``, those layers too), so the extraction pass
of scripts/train_mtp_head.py skips them (measured: no cost to the generation's tok/s).
``--bench-widths 32,48`` times 30 s of greedy answers at each width and stops.

    python -m specbatch.blas scripts/drafter_data.py --minutes 120 --capture --fuse-layers 2,15,29
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from drafter_capture import CaptureRunner, answer_ids, decode, write_chunks  # noqa: E402
from drafter_prompts import HELDOUT, build_prompts, encode_prompt, follow_up_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "drafters" / "data"


def text_files(rng: random.Random) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    py = [p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts]
    docs = [p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and not p.is_symlink()
            and (p.suffix in ("", ".txt", ".gz", ".md", ".rst") or p.name.lower().startswith(("readme", "changelog", "news")))
            and p.stat().st_size < 2_000_000]
    rng.shuffle(py)
    rng.shuffle(docs)
    return py + docs


def read_text(path: Path) -> str | None:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return text if text.strip() and "\x00" not in text else None


def make_text(tokenizer, seed: int, seq: int, max_tokens: int, folder: Path) -> None:
    out = folder / "text.npz"
    if out.exists():
        print(f"{out} exists: skipping text")
        return
    rng = random.Random(seed)
    files = text_files(rng)
    # alternate stdlib and docs so any prefix is a mix
    py = [f for f in files if f.suffix == ".py"]
    docs = [f for f in files if f.suffix != ".py"]
    order = [f for pair in zip(py, docs) for f in pair] + py[len(docs):] + docs[len(py):]
    seqs, sources, total = [], [], 0
    bar = tqdm(total=max_tokens, desc="text tokens", unit="tok")
    for f in order:
        text = read_text(f)
        if text is None:
            continue
        ids = tokenizer.encode(text[:200_000])
        for i in range(0, len(ids) - seq // 4, seq):  # drop short tails
            piece = ids[i:i + seq]
            if len(piece) < seq:
                piece = ids[-seq:] if len(ids) >= seq else None
            if piece is None:
                break
            seqs.append(piece)
            sources.append(0 if f.suffix == ".py" else 1)
            total += seq
            bar.update(seq)
        if total >= max_tokens:
            break
    bar.close()
    np.savez(out, tokens=np.array(seqs, dtype=np.int32), source=np.array(sources, dtype=np.int8))
    print(f"text: {len(seqs)} sequences x {seq} tokens ({sum(sources)} from docs)")



def row_seed(seed: int, name: str, i: int) -> int:
    return zlib.crc32(f"{seed}:{name}:{i}".encode()) & 0x7FFFFFFF


def magpie_batches(folder: Path) -> list[Path]:
    """The saved batches of self-written questions: magpie.json, then magpie_1.json, ..."""
    files = [folder / "magpie.json"]
    while files[-1].exists():
        files.append(folder / f"magpie_{len(files)}.json")
    return files[:-1]


def make_magpie(runner, tok, n: int, seed: int, deadline: float, folder: Path, width: int,
                max_tokens: int = 72) -> list[list[dict]]:
    """Questions the target writes itself after its chat template's pre-query prefix, as the
    saved batches; where they hold fewer than ``n`` in all, a new batch (its own seeds, no
    question repeated) tops them up, so a later run with a larger ``n`` adds prompts
    without touching the chunks answered from the earlier ones."""
    from specbatch.runtime.params import SamplingParams
    batches = [json.loads(p.read_text()) for p in magpie_batches(folder)]
    want = n - sum(map(len, batches))
    if want <= 0:
        return batches
    k = len(batches)
    path, stream = (folder / "magpie.json", "magpie") if k == 0 else (folder / f"magpie_{k}.json", f"magpie_{k}")
    marker = "XQZMARK"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    prefix = tok.encode(text[:text.index(marker)], add_special_tokens=False)
    held = json.loads(HELDOUT.read_text())
    seen = {p.strip().lower() for p in held["chat"] + held["code"]}
    seen |= {q["prompt"].strip().lower() for b in batches for q in b}
    out: list[dict] = []
    bar = tqdm(total=want, desc="self-written questions")
    tries = 0
    while len(out) < want and time.time() < deadline and tries < 4 * want:
        jobs = [(prefix, SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95,
                                        seed=row_seed(seed, stream, tries + i))) for i in range(2 * width)]
        tries += len(jobs)
        for r in decode(runner, tok, jobs, width, deadline):
            if r.finish_reason != "stop":  # cut off (or the time box): not a whole question
                continue
            q = tok.decode(answer_ids(r)).strip()
            if len(q) < 12 or q.lower() in seen or "<|im_" in q:
                continue
            seen.add(q.lower())
            out.append({"kind": "chat", "prompt": q, "source": "magpie"})
            bar.update(1)
    bar.close()
    out = out[:want]
    if out:  # an empty batch would end magpie_batches' numbering early
        path.write_text(json.dumps(out, indent=0))
        batches.append(out)
    print(f"{len(out)} new self-written questions, {sum(map(len, batches))} in {len(batches)} batch(es)")
    return batches


def generation_plan(items: list[dict], magpie: list[list[dict]], chunk: int, folder: Path) -> list[tuple[Path, list[dict], str]]:
    """(output file, prompts, mode) per chunk: templated chunks and the first batch of
    self-written ones alternate, later batches' chunks (``m<batch>-NNNN``) follow; each gives
    greedy, sampled, and second-turn files after either (mode "greedy", "sampled",
    "turn2:<file the first turn is in>")."""
    cut = lambda xs: [xs[c:c + chunk] for c in range(0, len(xs), chunk)]  # noqa: E731
    plain, mag = cut(items), cut(magpie[0]) if magpie else []
    named = []
    for i in range(max(len(plain), len(mag))):
        named += [(f"{c:04d}", plain[c]) for c in [i] if c < len(plain)]
        named += [(f"m{c:04d}", mag[c]) for c in [i] if c < len(mag)]
    for k, batch in enumerate(magpie[1:], 1):
        named += [(f"m{k}-{c:04d}", part) for c, part in enumerate(cut(batch))]
    order = []
    for name, part in named:
        greedy, sampled = folder / f"gen_{name}.json", folder / f"gen_s{name}.json"
        order += [(greedy, part, "greedy"), (sampled, part, "sampled"),
                  (folder / f"gen_t{name}.json", part, f"turn2:{greedy.name}"),
                  (folder / f"gen_ts{name}.json", part, f"turn2:{sampled.name}")]
    return order


def chunk_jobs(tok, path: Path, part: list[dict], mode: str, args) -> tuple[list[dict], list]:
    """The rows (without answers) and (prompt ids, SamplingParams) jobs of one chunk."""
    from specbatch.runtime.params import SamplingParams
    if mode.startswith("turn2:"):  # after each first-turn chat answer (a cut-off one too: most are), a follow-up
        first = json.loads((path.parent / mode[len("turn2:"):]).read_text())["rows"]
        rng = random.Random(row_seed(args.seed, path.name, 0))
        rows = []
        for row in first:
            if row["kind"] != "chat" or "finish" not in row:  # raw code completions stay single-turn
                continue
            follow, ids = follow_up_ids(tok, row, row["answer_ids"], rng)
            rows.append({**{k: v for k, v in row.items() if k not in ("prompt_ids", "answer_ids", "finish")},
                         "turn": 2, "first_finish": row["finish"], "follow_up": follow, "prompt_ids": ids})
    else:
        rows = [{**it, "mode": mode, "turn": 1, "prompt_ids": encode_prompt(tok, it)} for it in part]
    jobs = []
    for i, row in enumerate(rows):
        temp = args.temperature if row["mode"] == "sampled" else 0.0
        jobs.append((row["prompt_ids"], SamplingParams(max_tokens=args.max_tokens, temperature=temp,
                                                       seed=row_seed(args.seed, path.name, i))))
    return rows, jobs


def make_generations(runner, tok, plan, args, deadline: float) -> int:
    """Answer the plan's chunks in order (a saved chunk is skipped); the answer tokens made."""
    done = sum(path.exists() for path, _, _ in plan)
    bar = tqdm(total=len(plan), initial=done, desc="generation chunks")
    made = 0
    for path, part, mode in plan:
        if path.exists():
            continue
        if mode.startswith("turn2:") and not (path.parent / mode[len("turn2:"):]).exists():
            continue  # its first turn was cut by a time box
        t0 = time.time()
        rows, jobs = chunk_jobs(tok, path, part, mode, args)
        requests = decode(runner, tok, jobs, args.width, deadline)
        if time.time() > deadline:
            print("time box reached: stopping generation (this chunk is not saved)")
            break
        if isinstance(runner, CaptureRunner):  # --capture: the chunk's features, before its answers
            seqs = [runner.sequence(i, r.prompt + r.tokens[:-1]) for i, r in enumerate(requests)]
            write_chunks([s for s in seqs if s is not None], f"gen{path.stem[4:]}", args.feats)
            runner.reset()
        for row, r in zip(rows, requests):
            row["answer_ids"], row["finish"] = answer_ids(r), r.finish_reason
        n = sum(len(r["answer_ids"]) for r in rows)
        made += n
        tmp = path.with_name(path.stem + ".tmp")
        tmp.write_text(json.dumps({"rows": rows, "seconds": time.time() - t0, "tokens": n, "width": args.width}))
        tmp.replace(path)  # atomic: a killed run leaves no half chunk
        bar.update(1)
        bar.set_postfix(tok_s=f"{n / (time.time() - t0):.0f}", tokens=made)
    bar.close()
    return made


def bench_widths(runner, tok, items: list[dict], widths: list[int], seconds: float, max_tokens: int) -> None:
    """Greedy answer tokens per second at each width over ``seconds`` (prefills included)."""
    from specbatch.runtime.params import SamplingParams
    jobs = [(encode_prompt(tok, it), SamplingParams(max_tokens=max_tokens, seed=0)) for it in items]
    for w in widths:
        t0 = time.time()
        reqs = decode(runner, tok, jobs[:6 * w], w, t0 + seconds)
        n = sum(len(r.tokens) for r in reqs)
        print(f"width {w}: {n} answer tokens in {time.time() - t0:.1f} s = {n / (time.time() - t0):.0f} tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=120.0, help="time box for the whole script (about 1M answer tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq", type=int, default=512, help="teacher-forcing sequence length")
    ap.add_argument("--text-tokens", type=int, default=1_500_000, help="text tokens to keep")
    ap.add_argument("--width", type=int, default=48, help="rows decoded at once (measured best of 32/48/64)")
    ap.add_argument("--chunk", type=int, default=192, help="prompts per saved chunk")
    ap.add_argument("--prompts", type=int, default=None, help="templated prompts kept (default: all)")
    ap.add_argument("--magpie", type=int, default=1200, help="self-written questions to answer")
    ap.add_argument("--magpie-minutes", type=float, default=12.0, help="time box for writing them (about 1,200 at width 48)")
    ap.add_argument("--max-tokens", type=int, default=256, help="answer length cap")
    ap.add_argument("--temperature", type=float, default=0.7, help="of the sampled answers")
    ap.add_argument("--target", default=None, help="the target (default: the embedded one)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--bench-widths", default=None, help="e.g. 32,48,64: time each width and stop")
    ap.add_argument("--capture", action="store_true", help="write the answers' features while generating")
    ap.add_argument("--fuse-layers", default="", help="with --capture: the layers to keep too, e.g. 2,15,29")
    ap.add_argument("--feats", type=Path, default=ROOT / "build" / "drafters" / "feats",
                    help="with --capture: the feature folder (a fused one: <feats>_l<layers>)")
    args = ap.parse_args()
    deadline = time.time() + args.minutes * 60
    from specbatch.kernels.models import demo_pair, load
    from specbatch.kernels.runner import ModelRunner
    target = load(args.target or demo_pair()["target"])
    runner, tok = ModelRunner(target.model), target.tokenizer
    items = build_prompts(args.seed)[:args.prompts]
    if args.bench_widths:
        return bench_widths(runner, tok, items, [int(w) for w in args.bench_widths.split(",")], 30.0, args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prompts.json").write_text(json.dumps(items, indent=0))
    print(f"{len(items)} training prompts ({sum(i['kind'] == 'code' for i in items)} code)")
    make_text(tok, args.seed, args.seq, args.text_tokens, args.out)
    magpie = make_magpie(runner, tok, args.magpie, args.seed, min(deadline, time.time() + args.magpie_minutes * 60),
                         args.out, args.width)
    if args.capture:
        fuse = tuple(int(i) for i in args.fuse_layers.split(",") if i.strip())
        runner = CaptureRunner(target.model, fuse)
        args.feats = args.feats if not fuse else args.feats.with_name(f"{args.feats.name}_l{'-'.join(map(str, fuse))}")
    made = make_generations(runner, tok, generation_plan(items, magpie, args.chunk, args.out), args, deadline)
    total = sum(json.loads(p.read_text())["tokens"] for p in args.out.glob("gen_*.json"))
    print(f"answer tokens: {made} this run, {total} in {args.out}")


if __name__ == "__main__":
    main()
