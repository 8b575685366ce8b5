"""Width-1 engine check on held-out chat prompts: a drafter vs plain decoding at each
temperature (seeded), both engines in one process, prompts alternating which runs first;
tokens/s side by side (end to end, and decode alone: after each first token), acceptance, tokens
per verify round, and token ids compared.

    python -m specbatch.blas scripts/engine_compare.py --drafter mtp --draft-model DIR -n 8 --temperatures 0,0.7,1.0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import drafter_common as dc  # noqa: E402

from specbatch import SamplingParams, from_pretrained  # noqa: E402


def one(engine, prompt, max_tokens, temperature, seed):
    """(token ids, seconds from submit to the end, seconds from the first token to the end)."""
    t = time.perf_counter()
    handle = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))
    first = None
    for event in handle:
        if first is None and event.token is not None:
            first = time.perf_counter()
    end = time.perf_counter()
    return list(handle.result(600).token_ids), end - t, end - (first or end)


def acceptance(before: dict, after: dict) -> dict:
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    rounds = sum(after["acceptance_histogram"].values()) - sum(before["acceptance_histogram"].values())
    return {"acceptance": round(accepted / drafted, 3) if drafted else 0.0,
            "tokens_per_round": round((accepted + rounds) / rounds, 3) if rounds else None}


def compare(plain, spec, prompts, max_tokens, temperature) -> dict:
    """Plain and speculative engines on the same prompts, alternating which goes first."""
    secs, decode, n, same = {"plain": 0.0, "spec": 0.0}, {"plain": 0.0, "spec": 0.0}, 0, True
    before = spec.stats()
    for i, p in enumerate(prompts):
        order = [("plain", plain), ("spec", spec)][:: 1 if i % 2 == 0 else -1]
        got = {}
        for name, engine in order:
            got[name], dt, after_first = one(engine, p, max_tokens, temperature, seed=1000 + i)
            secs[name] += dt
            decode[name] += after_first
        same &= got["plain"] == got["spec"]
        n += len(got["plain"])
    plain_tok_s, spec_tok_s = n / secs["plain"], n / secs["spec"]
    # decode alone: the tokens after each first one, over the time after it (prefill and the
    # first token out, which speculation does not touch)
    later = n - len(prompts)
    plain_dec, spec_dec = later / decode["plain"], later / decode["spec"]
    return {"temperature": temperature, "plain_tok_s": round(plain_tok_s, 2), "spec_tok_s": round(spec_tok_s, 2),
            "speedup": round(spec_tok_s / plain_tok_s, 3), "plain_decode_tok_s": round(plain_dec, 2),
            "spec_decode_tok_s": round(spec_dec, 2), "decode_speedup": round(spec_dec / plain_dec, 3),
            "identical": same, "tokens": n, **acceptance(before, spec.stats())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--drafter", default="mtp", choices=["mtp", "model", "ngram"])
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("-n", type=int, default=4, help="held-out chat prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0", help="comma-separated; seeded, so streams must match")
    ap.add_argument("--prompt-lookup", type=int, default=0,
                    help="the drafter's rounds only (0), or prompt lookup beside it after this many matching tokens")
    ap.add_argument("--tree", default="chain", help="the width-1 tree (e.g. 2,1,1,1@0.2); chain: k-long chains")
    ap.add_argument("--kv-layout", default=None, choices=["dense", "paged"],
                    help="the plain engine's batch KV (a lone plain request decodes in the batch loop)")
    ap.add_argument("--out", default=None, help="append the JSON lines here too")
    args = ap.parse_args()
    target = dc.load_target()
    tok = target.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
               for p in dc.heldout_prompts()["chat"][:args.n]]
    del target
    layout = {"kv_layout": args.kv_layout} if args.kv_layout else {}
    with from_pretrained(speculation=False, **layout) as plain, \
            from_pretrained(draft_model=args.draft_model, drafter=args.drafter, num_draft_tokens=args.k,
                                   speculative_width_cap=1, max_spec_temperature=None,
                                   fixed_draft=True, tree_shape=args.tree, tree_max_temperature=None,
                                   prompt_lookup=args.prompt_lookup) as spec:
        for engine in (plain, spec):
            one(engine, prompts[0], 8, 0.0, 0)  # warm-up
        for temperature in (float(x) for x in args.temperatures.split(",")):
            res = {"drafter": args.drafter, "draft_model": args.draft_model, "k": args.k, "tree": args.tree,
                   "prompts": args.n,
                   **compare(plain, spec, prompts, args.max_tokens, temperature)}
            print(json.dumps(res), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
