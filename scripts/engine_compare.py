"""Width-1 engine check on held-out chat prompts at temperature 0: a drafter vs plain
decoding, in one process, tokens/s side by side and token ids compared.

    python -m specbatch.blas scripts/engine_compare.py --drafter mtp --draft-model DIR -n 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import drafter_common as dc  # noqa: E402

from specbatch import Engine, SamplingParams  # noqa: E402


def run(engine, prompts, max_tokens):
    out, secs, n = [], 0.0, 0
    for p in prompts:
        t = time.perf_counter()
        r = engine.submit(p, SamplingParams(max_tokens=max_tokens, temperature=0.0)).result(600)
        secs += time.perf_counter() - t
        out.append(list(r.token_ids))
        n += len(r.token_ids)
    return out, n / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--drafter", default="mtp", choices=["mtp", "model", "ngram"])
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("-n", type=int, default=4, help="held-out chat prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    target = dc.load_target()
    tok = target.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
               for p in dc.heldout_prompts()["chat"][:args.n]]
    del target
    res = {}
    with Engine.from_pretrained(speculation=False) as plain:
        run(plain, prompts[:1], 8)  # warm-up
        ref, res["plain_tok_s"] = run(plain, prompts, args.max_tokens)
    with Engine.from_pretrained(draft_model=args.draft_model, drafter=args.drafter, num_draft_tokens=args.k,
                                speculative_width_cap=1) as spec:
        run(spec, prompts[:1], 8)
        got, res["spec_tok_s"] = run(spec, prompts, args.max_tokens)
    res.update(drafter=args.drafter, k=args.k, prompts=args.n, max_tokens=args.max_tokens,
               speedup=round(res["spec_tok_s"] / res["plain_tok_s"], 3), identical=got == ref,
               tokens=sum(len(r) for r in ref))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
