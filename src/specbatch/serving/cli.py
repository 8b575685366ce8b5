"""``specbatch``: generate, demo, bench, statechart (and serve, calibrate where built)."""

from __future__ import annotations

import argparse
import sys

from ..blas import ensure_openblas


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="target: mlx-lm folder, GGUF file or HF id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", default=None, help="drafter with the target's vocabulary (or an MTP head folder)")
    p.add_argument("--drafter", default=None, choices=["model", "mtp", "ngram"],
                   help="a separate draft model, the target's multi-token-prediction head, or "
                        "prompt lookup in the request's own tokens (default: 'model' with --draft-model, "
                        "else the embedded target's trained drafter, else prompt lookup)")
    p.add_argument("--no-speculation", action="store_true", help="decode plain")
    p.add_argument("--speculative-width-cap", type=int, default=None,
                   help="widest batch that still speculates (0 = uncapped)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tokens drafted per round (k)")
    p.add_argument("--tree-shape", default=None,
                   help="token tree a lone request drafts, branching per depth, e.g. 2,1,1, or a dynamic "
                        "one bounded by it, e.g. 3,2,1@0.1 ('chain': chains; default: the calibrated shape, else chains)")
    p.add_argument("--prompt-lookup", type=int, default=None,
                   help="a lone stream whose last N tokens occurred before drafts what followed them where the "
                        "policy expects it to pay, beside the MTP head (default 4; 0: never)")
    p.add_argument("--dtype", default=None,
                   help="float32 | float16 | bfloat16 | quantized (keep a checkpoint's quantized weights) | auto "
                        "(fp32 on CPU, the checkpoint's own on a GPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion served, tokens (default: the model's context)")
    p.add_argument("--kv-bits", type=int, default=None, choices=[4, 8],
                   help="store the batch's target KV quantized per token (default: the model's dtype)")
    p.add_argument("--kv-layout", default=None, choices=["dense", "paged"],
                   help="the batch's KV: paged blocks (the default: allocation within 10%% of need, decode "
                        "within ~5%% of dense) or dense buffers (rows padded to the longest); --kv-bits implies paged")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill forward; while requests decode, a longer prompt prefills one "
                        "chunk between two of their rounds (default: calibrated for the target, else 128)")
    p.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                   help="prefill a long arrival whole at admission (live streams wait for all of it)")
    p.add_argument("--log-format", default="console", choices=["console", "json"])
    p.add_argument("-v", "--verbose", action="store_true")


def _distributed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", action="store_true",
                   help="shard the target across the ranks of an mlx.launch job (rank 0 serves)")
    p.add_argument("--backend", default="ring", help="MLX distributed backend (ring, mpi, nccl)")
    p.add_argument("--peer-timeout", type=float, default=60.0,
                   help="seconds without a message from the other ranks before they count as lost")


def _engine(args, **options):
    """The engine (rank 0 / single process), or None on a follower rank once it is done."""
    from ..kernels.build import from_pretrained
    options = dict(options, speculation=not args.no_speculation, speculative_width_cap=args.speculative_width_cap,
                   num_draft_tokens=args.num_draft_tokens, dtype=args.dtype, drafter=args.drafter,
                   **({"max_model_len": args.max_model_len} if args.max_model_len else {}),
                   **({"kv_bits": args.kv_bits} if args.kv_bits else {}),
                   **({"kv_layout": args.kv_layout} if args.kv_layout else {}),
                   prefill_chunk=args.prefill_chunk, chunked_prefill=args.chunked_prefill,
                   **({"tree_shape": args.tree_shape} if getattr(args, "tree_shape", None) else {}),
                   **({"prompt_lookup": args.prompt_lookup} if getattr(args, "prompt_lookup", None) is not None else {}))
    if not getattr(args, "distributed", False):
        return from_pretrained(args.model, args.draft_model, **options)
    from .dist import sharded_engine
    return sharded_engine(args.model, args.draft_model, backend=args.backend, timeout_s=args.peer_timeout,
                          **options)


def cmd_generate(args) -> int:
    from .. import SamplingParams
    from ..kernels.models import chat_prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    engine = _engine(args)
    if engine is None:  # a follower rank: it replayed the driver's rounds
        return 0
    with engine:
        chat = None if args.raw else chat_prompt(engine.tokenizer, args.prompt)
        handle = engine.submit(chat or args.prompt, params)
        if chat is None:  # plain completion: the continuation reads on from the prompt
            sys.stdout.write(args.prompt)
        for event in handle:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if args.verbose:
            done = handle.result()
            print(f"[{done.finish_reason}] {done.usage.completion_tokens} tokens, seed {done.seed}; "
                  f"stats {engine.stats()}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .http.serve import serve
    engine = _engine(args, max_queue=args.max_queue, kv_budget_bytes=args.kv_budget_mb << 20,
                     prompt_cache_bytes=args.prompt_cache_mb << 20)
    return 0 if engine is None else serve(args, engine)


def cmd_demo(args) -> int:
    from ..tools.demo import run_demo
    return run_demo(args)


def cmd_bench(args) -> int:
    from ..tools.bench.run import run_bench
    return run_bench(args)


def cmd_calibrate(args) -> int:
    from ..tools.calibrate import run_calibrate
    return run_calibrate(args)


def cmd_convert(args) -> int:
    from ..kernels.gguf import convert
    out = convert(args.gguf, args.out, dequantize=args.dtype == "float32")
    print(f"wrote {out} (open it with mlx_lm.load or --model {out})")
    return 0


def cmd_statechart(args) -> int:
    from ..tools.statechart import run_statechart
    return run_statechart(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specbatch", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream one completion to stdout")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true",
                   help="plain completion of the prompt (default: one user turn in the model's chat template)")
    _model_args(g)
    _distributed_args(g)
    g.set_defaults(func=cmd_generate)

    _serve_parser(sub)

    d = sub.add_parser("demo", help="staggered concurrent requests, live transitions, a summary")
    d.add_argument("--requests", type=int, default=6)
    d.add_argument("--max-tokens", type=int, default=48)
    _model_args(d)
    d.set_defaults(func=cmd_demo)

    _measuring_parsers(sub)

    cv = sub.add_parser("convert", help="write a GGUF file (llama, mistral, qwen2) as an mlx-lm model folder")
    cv.add_argument("gguf")
    cv.add_argument("out")
    cv.add_argument("--dtype", default="native", choices=["native", "float32"],
                    help="native: keep the file's quantized weights; float32: dequantize")
    cv.set_defaults(func=cmd_convert)

    s = sub.add_parser("statechart", help="write or check the Mermaid chart of the machine")
    s.add_argument("--write", action="store_true")
    s.add_argument("--check", action="store_true")
    s.add_argument("--trace", default=None, help="JSON log of a run: draw the path it took")
    s.set_defaults(func=cmd_statechart)
    return ap


def _serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-queue", type=int, default=256)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or SPECBATCH_API_KEY)")
    sv.add_argument("--max-body", type=int, default=1 << 20, help="request body limit, bytes")
    sv.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection may take to send a request's line and headers (then closed, "
                         "with a 408 if it sent part of one; 0: no limit)")
    sv.add_argument("--body-timeout", type=float, default=60.0,
                    help="seconds a request body may take to arrive (then 408, connection closed)")
    sv.add_argument("--keep-alive-timeout", type=float, default=5.0,
                    help="seconds a kept-alive connection may stay idle between requests")
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--kv-budget-mb", type=int, default=0, help="target KV budget; admission waits past it (0: none)")
    sv.add_argument("--prompt-cache-mb", type=int, default=256, help="prompt (prefix) cache bound")
    sv.add_argument("--shutdown-grace", type=float, default=30.0,
                    help="seconds live requests get to finish after SIGTERM before they are cut")
    _model_args(sv)
    _distributed_args(sv)
    sv.set_defaults(func=cmd_serve)


def _measuring_parsers(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks side by side with mlx-lm")
    b.add_argument("--suite", default="kernels,plain,scalar,widths,transitions,memory,serving,drafters,sharded,long_prompts",
                   help="comma list of: plain, scalar, widths, transitions, memory, serving, drafters, sharded, "
                        "long_prompts, memory_layout, prefix_cache, policy (the policy against every fixed chain on held-out mixed rows), trees (chain vs tree drafting at width 1; not in "
                        "the default list)")
    b.add_argument("--long-prompt-tokens", type=int, default=2000, help="long_prompts: tokens per arriving prompt")
    b.add_argument("--long-arrivals", type=int, default=2, help="long_prompts: prompts arriving while streams decode")
    b.add_argument("--widths", default="1,2,4,8,16")
    b.add_argument("--tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--out", default="bench/results")
    b.add_argument("--no-report", dest="report", action="store_false", help="skip plots and docs/benchmarks.md")
    b.add_argument("--report-from", default=None, metavar="FILES",
                   help="run nothing: write plots and docs/benchmarks.md from these results files (comma list; "
                        "each suite from the last file that has it)")
    _model_args(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("calibrate", help="measure the prefill chunk for the target, and the draft length per "
                                         "width and temperature for this pair on this machine (the schedule; "
                                         "its widest k > 0 is the cap)")
    c.add_argument("--measure", default="all", choices=["all", "prefill", "schedule", "trees"],
                   help="trees: only the tree shapes, on the pair's stored chain schedule")
    c.add_argument("--prefill-chunks", default="16,32,48,64,96,128,192,256,384,512",
                   help="prefill chunk sizes to time")
    c.add_argument("--prefill-gap", type=float, default=6.0,
                   help="the largest chunk costing at most this many decode steps is chosen")
    c.add_argument("--prefill-context", type=int, default=1024,
                   help="tokens already in the cache when a chunk is timed (mid-way into a 2,000-token prompt)")
    c.add_argument("--widths", default="1,2,4,8,16")
    c.add_argument("--draft-lengths", default="1,2,3,4,6", help="draft lengths to try at each width")
    c.add_argument("--tokens", type=int, default=64,
                   help="tokens a cell's rows decode (32-token cells at widths >= 2 mispredicted 64-token decoding)")
    c.add_argument("--repeats", type=int, default=3, help="interleaved repeats a cell's rate is the median of")
    c.add_argument("--margin", type=float, default=0.05,
                   help="speculation must win by this much (3%% let width-4 cells of +3.6%% through that lost 12%% in the widths bench)")
    from ..tools.calibrate_tree import CANDIDATES
    c.add_argument("--tree-shapes", default=CANDIDATES,
                   help="width-1 token trees to try against the chain, ';'-separated; b1,b2,..@s is a "
                        "dynamic tree (the MTP head keeps nodes whose path score reaches s) ('' : chains only)")
    c.add_argument("--tree-prompts", type=int, default=12,
                   help="held-out chat prompts per tree measurement (4 picked a tree that lost on 20 others)")
    _model_args(c)
    c.set_defaults(func=cmd_calibrate)


def main(argv: list[str] | None = None) -> int:
    ensure_openblas()
    args = build_parser().parse_args(argv)
    from .. import logs
    from ..blas import active_blas, blas_core
    logs.configure(getattr(args, "log_format", "console"), "info" if getattr(args, "verbose", False) else None)
    from ..openblas import limit_threads, share_cores
    # the BLAS never runs more threads than this process's cores; a server's BLAS and CPU
    # kernels share them (before the kernels' pool starts, which `cpu.status()` below does)
    threads = share_cores()[0] if args.func is cmd_serve else limit_threads()
    if getattr(args, "verbose", False):
        from ..kernels import cpu
        state = cpu.status()
        kernels = f"specbatch ({state.isa})" if state.active else f"MLX ops ({state.why})"
        core = blas_core()
        print(f"specbatch: BLAS = {active_blas()}{f' [{core}]' if core else ''} ({threads} threads); "
              f"CPU kernels = {kernels}", file=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"specbatch: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a follower rank that lost the driver, a backend that failed
        print(f"specbatch: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
