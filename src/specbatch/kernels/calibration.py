"""Calibrated draft-length schedules (and the cap they imply), keyed by model pair and machine,
and the prefill chunk per target, written by ``specbatch calibrate`` (``tools.calibrate``)."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import attrs

from ..runtime.policy import PRIOR_ACCEPTANCE, CostModel, Prior
from ..runtime.schedule import DraftSchedule


def calibration_file() -> Path:
    base = os.environ.get("SPECBATCH_CALIBRATION") or Path.home() / ".cache" / "specbatch" / "calibration.json"
    return Path(base)


def machine_key() -> str:
    """This machine's calibration: OS, architecture, CPUs, the CPU kernels' ISA (a verify's cost
    differs by ISA: at 8 positions 1.19x a step with AVX-512, 1.72x with AVX2) and the device."""
    import mlx.core as mx

    from .cpu import status
    state = status()
    kernels = state.isa if state.active else "mlxops"
    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu-{kernels}-{mx.default_device()}"


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's vendor, family and model numbers as Linux reports them (``AuthenticAMD-25-17``;
    a VM often hides the model name but not these), from ``cpuinfo`` or /proc/cpuinfo; '' where
    they are missing."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip() and fields:
            break  # the first processor's block is enough
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    parts = [fields.get(k, "") for k in ("vendor_id", "cpu family", "model")]
    return "-".join(parts) if all(parts) else ""


def machine_keys() -> list[str]:
    """The keys a lookup tries, the most specific first: this CPU model, then any CPU of its ISA
    class (three AVX-512 CPUs measured speculation at width 1 from 1.07x to 1.25x plain, so one
    schedule does not fit them all)."""
    base, model = machine_key(), cpu_model()
    return [f"{base}-{model}", base] if model else [base]


def store_key() -> str:
    """The key ``specbatch calibrate`` writes: this CPU model's."""
    return machine_keys()[0]


def pair_key(target: str, drafter: str | None) -> str:
    return f"{Path(target).name}+{Path(drafter).name if drafter else 'none'}"


SHIPPED = Path(__file__).parents[1] / "demo_models" / "calibration.json"  # measured for the demo pair


def lookup(target: str, drafter: str | None, field: str = "cap", kind=int):
    """A calibrated value ("cap", "k" or "max_temperature"; "": the whole entry) for this pair on this machine:
    the user's own calibration first, then the one shipped with the demo pair; in each, this
    CPU model's entry first, then its ISA class's (``machine_keys``)."""
    for path in (calibration_file(), SHIPPED):
        if not path.exists():
            continue
        try:
            table = json.loads(path.read_text())
        except ValueError:  # json.JSONDecodeError included
            continue
        for key in machine_keys():
            try:
                value = table[key][pair_key(target, drafter)]
                value = value[field] if field else value
                return None if value is None else kind(value)
            except (KeyError, ValueError, TypeError):
                continue
    return None


def lookup_cap(target: str, drafter: str | None) -> int | None:
    return lookup(target, drafter, "cap")


def store(target: str, drafter: str | None, schedule: DraftSchedule, measured: dict, extra: dict | None = None) -> Path:
    """Write the pair's entry: the schedule, the cap and k it implies, the tokens/s each
    choice was made from, and ``extra`` fields (the width-1 tree: ``tree``,
    ``tree_max_temperature``, ``tree_measured``)."""
    entry = {"schedule": schedule.to_json(), "cap": schedule.cap(), "k": max(1, schedule.max_k()),
             "measured_tok_s": measured, **(extra or {})}
    return store_fields(target, drafter, entry, replace=True)


def store_fields(target: str, drafter: str | None, fields: dict, replace: bool = False) -> Path:
    """Merge ``fields`` into the pair's entry on this machine (``replace``: the entry is
    exactly ``fields``). The prefill chunk lives under the target with no drafter."""
    path = calibration_file()
    table = json.loads(path.read_text()) if path.exists() else {}
    pairs = table.setdefault(store_key(), {})
    key = pair_key(target, drafter)
    pairs[key] = dict(fields) if replace else {**pairs.get(key, {}), **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return path


def _least_squares(points: list) -> tuple[float, float] | None:
    """(intercept, slope) of ``points`` [(x, y)]; None below two distinct x."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    n = len(points)
    mx_, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx_) * (y - my) for x, y in points) / sum((x - mx_) ** 2 for x, _ in points)
    return my - slope * mx_, slope


def _greedy_tok_s(measured: dict, k: str) -> dict:
    """{width: tokens/s} of draft length ``k`` ("0": plain) in the greedy rows of ``measured``."""
    out = {}
    for key, by_k in measured.items():
        band, _, width = key.partition(" width=")
        if band == "T=0.0" and k in by_k and by_k[k]:
            out[int(width)] = float(by_k[k])
    return out


def derive_prior(entry: dict, base: dict) -> Prior:
    """A conservative prior where the calibration has no cost table: the target's forward
    fitted to the plain rounds (seconds = width / tokens/s, or the stored decode step), the
    acceptance at position 1 from the measured chain of one (deeper positions: the same),
    and the drafter step as what a chain of one cost beyond its forward at that acceptance
    (the widest such gap, so the policy never expects more than was measured)."""
    measured = entry.get("measured_tok_s") or {}
    plain = _greedy_tok_s(measured, "0")
    fit = _least_squares([(w, w / t) for w, t in plain.items()])
    step = base.get("decode_step_s")
    if fit is None or fit[1] <= 0:
        fixed = step if step else (1 / plain[min(plain)] if plain else CostModel().target_fixed_s)
        fit = (fixed, fixed * CostModel().target_token_s)
    chain = (entry.get("tree_measured") or {}).get("T=0.0 width=1", {}).get("chain k=1", {})
    a = min(max(chain.get("tokens_per_round", 1 + PRIOR_ACCEPTANCE) - 1.0, 0.0), 1.0)
    cost = CostModel(fit[0], fit[1], 0.0, 0.0)
    gaps = [w * (1 + a) / t - cost.forward_s(w, 2) for w, t in _greedy_tok_s(measured, "1").items()]
    draft = max([g for g in gaps if g > 0], default=0.1 * fit[0])
    return Prior(attrs.evolve(cost, draft_fixed_s=draft), (a,))


def prior_for(target: str, drafter: str | None) -> Prior:
    """The pair's stored prior ("cost" and "acceptance"), else one derived from what it has."""
    entry = lookup(target, drafter, "", _entry) or {}
    base = lookup(target, None, "", _entry) or {}
    if "cost" in entry and entry.get("acceptance"):
        return Prior(CostModel.from_json(entry["cost"]), entry["acceptance"], entry.get("acceptance_bands", ()))
    return derive_prior(entry, base)


def _entry(value):
    return dict(value)


def acceptance_by_position(histogram: dict, drafted: int) -> list[float]:
    """Conditional acceptance per draft position from rounds of ``drafted`` drafts:
    ``histogram[n]`` rows accepted exactly n; position i accepts P(>= i) / P(>= i - 1).
    (Rounds cut short by a budget's tail count as accepting what they drafted.)"""
    counts = {int(n): c for n, c in histogram.items()}
    at_least = [sum(c for n, c in counts.items() if n >= i) for i in range(drafted + 1)]
    return [round(at_least[i] / at_least[i - 1], 4) for i in range(1, drafted + 1) if at_least[i - 1]]


def acceptance_bands(cell_acceptance: dict) -> list[list]:
    """Acceptance by position per temperature band, from the cells' accepted / drafted
    (``"T=t width=w" -> {k: rate}``): position 1 is a chain of one's rate, position 2
    follows from a chain of two's (``rate = (a1 + a1 * a2) / 2``); medians over widths."""
    by_band: dict[float, dict[int, list[float]]] = {}
    for key, rates in cell_acceptance.items():
        band = by_band.setdefault(float(key.split()[0][2:]), {1: [], 2: []})
        a1 = rates.get("1")
        if a1:
            band[1].append(float(a1))
            if rates.get("2") is not None:
                band[2].append(min(max(2.0 * float(rates["2"]) / float(a1) - 1.0, 0.0), 1.0))
    out = []
    for t, band in sorted(by_band.items()):
        acc = [round(statistics.median(band[i]), 4) for i in (1, 2) if band[i]]
        if acc:
            out.append([t, acc])
    return out
