"""Calibrated width caps, keyed by model pair and machine (written by ``specbatch calibrate``)."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path


def calibration_file() -> Path:
    base = os.environ.get("SPECBATCH_CALIBRATION") or Path.home() / ".cache" / "specbatch" / "calibration.json"
    return Path(base)


def machine_key() -> str:
    import mlx.core as mx
    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu-{mx.default_device()}"


def pair_key(target: str, drafter: str | None) -> str:
    return f"{Path(target).name}+{Path(drafter).name if drafter else 'none'}"


SHIPPED = Path(__file__).parent / "demo_models" / "calibration.json"  # measured for the demo pair


def lookup(target: str, drafter: str | None, field: str = "cap", kind=int):
    """A calibrated value ("cap", "k" or "max_temperature") for this pair on this machine:
    the user's own calibration first, then the one shipped with the demo pair."""
    for path in (calibration_file(), SHIPPED):
        if not path.exists():
            continue
        try:
            table = json.loads(path.read_text())
            value = table[machine_key()][pair_key(target, drafter)][field]
            return None if value is None else kind(value)
        except (KeyError, ValueError, TypeError, json.JSONDecodeError):
            continue
    return None


def lookup_cap(target: str, drafter: str | None) -> int | None:
    return lookup(target, drafter, "cap")


def store_cap(target: str, drafter: str | None, cap: int, curve: dict, k: int | None = None,
              hot: dict | None = None) -> Path:
    """Write the entry; ``hot``: {"max_temperature": T or None, "curve": {T: ratio}}."""
    path = calibration_file()
    table = json.loads(path.read_text()) if path.exists() else {}
    entry = {"cap": cap, "curve": curve, **({"k": k} if k else {})}
    if hot is not None:
        entry.update(max_temperature=hot["max_temperature"], temperature_curve=hot["curve"])
    table.setdefault(machine_key(), {})[pair_key(target, drafter)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return path


def choose_cap(curve: dict[int, float], margin: float = 0.03) -> int:
    """The widest width up to which speculation wins by ``margin`` at every width.

    ``curve`` maps width -> speculative / plain tokens/s. Never below 1 (0 would mean
    uncapped); a curve that loses at width 1 says speculation does not pay here.
    """
    cap = 1
    for width in sorted(curve):
        if curve[width] < 1.0 + margin:
            break
        cap = width
    return cap


TEMPERATURES = (0.0, 0.35, 0.7, 1.0)


def choose_max_temperature(curve: dict[float, float], margin: float = 0.03) -> float | None:
    """The hottest temperature up to which speculation wins at width 1 (``curve``: T ->
    speculative / plain). None: it wins everywhere measured; -1: not even at T = 0."""
    best = -1.0
    for t in sorted(curve):
        if curve[t] < 1.0 + margin:
            return best
        best = t
    return None


def _temperature_curve(plain, spec, prompt, args) -> dict[float, float]:
    from .bench import engine_tok_s
    curve = {}
    for t in TEMPERATURES:
        p = statistics.median(engine_tok_s(plain, prompt, args.tokens, temperature=t) for _ in range(args.repeats))
        s = statistics.median(engine_tok_s(spec, prompt, args.tokens, temperature=t) for _ in range(args.repeats))
        curve[t] = s / p
        print(f"temperature {t:.2f}: speculative / plain = {curve[t]:.3f} (width 1)", flush=True)
    return curve


def run_calibrate(args) -> int:
    from .bench import Context, engine_tok_s, code_prompts
    from .config import load_pair

    target, drafter, config = load_pair(args.model, args.draft_model, dtype=args.dtype, drafter=args.drafter,
                                        num_draft_tokens=args.num_draft_tokens, speculative_width_cap=0)
    if drafter is None:
        raise ValueError("calibration needs a drafter (the embedded pair has one)")
    widths = [int(w) for w in args.widths.split(",")]
    ctx = Context(target, drafter, config, widths, args.tokens, args.repeats)
    plain = ctx.engine(speculation=False)
    prompts = code_prompts(target.tokenizer, max(widths))
    curve = {}
    try:
        k = config.num_draft_tokens if args.num_draft_tokens else _best_k(ctx, prompts[:1], args)
        spec = ctx.engine(speculative_width_cap=0, num_draft_tokens=k, max_spec_temperature=None)
        temps = _temperature_curve(plain, spec, prompts[:1], args)
        for width in widths:
            p = statistics.median(engine_tok_s(plain, prompts[:width], args.tokens) for _ in range(args.repeats))
            s = statistics.median(engine_tok_s(spec, prompts[:width], args.tokens) for _ in range(args.repeats))
            curve[width] = s / p
            print(f"width {width:3d}: speculative / plain = {curve[width]:.3f}", flush=True)
    finally:
        ctx.close()
    cap = choose_cap(curve, args.margin)
    hot = choose_max_temperature(temps, args.margin)
    path = store_cap(target.name, drafter.name, cap, {str(w): r for w, r in curve.items()}, k,
                     {"max_temperature": hot, "curve": {str(t): r for t, r in temps.items()}})
    note = "" if curve.get(min(curve), 0) >= 1 + args.margin else " (speculation does not pay here: consider --no-speculation)"
    print(f"k = {k}, cap = {cap}, speculating up to temperature {hot}{note}; written to {path} "
          f"for {machine_key()} / {pair_key(target.name, drafter.name)}")
    return 0


def _best_k(ctx, prompt, args) -> int:
    """The draft length that is fastest alone (width 1, temperature 0)."""
    from .bench import engine_tok_s
    speeds = {}
    for k in (2, 3, 4, 5, 6):
        engine = ctx.engine(speculative_width_cap=1, num_draft_tokens=k, max_spec_temperature=None)
        speeds[k] = statistics.median(engine_tok_s(engine, prompt, args.tokens) for _ in range(args.repeats))
        print(f"k {k}: {speeds[k]:.1f} tok/s alone", flush=True)
    return max(speeds, key=speeds.get)
