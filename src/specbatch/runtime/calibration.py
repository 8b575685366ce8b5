"""Calibrated draft-length schedules (and the cap they imply), keyed by model pair and machine,
and the prefill chunk per target, written by ``specbatch calibrate`` (``tools.calibrate``)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from .schedule import DraftSchedule


def calibration_file() -> Path:
    base = os.environ.get("SPECBATCH_CALIBRATION") or Path.home() / ".cache" / "specbatch" / "calibration.json"
    return Path(base)


def machine_key() -> str:
    import mlx.core as mx
    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu-{mx.default_device()}"


def pair_key(target: str, drafter: str | None) -> str:
    return f"{Path(target).name}+{Path(drafter).name if drafter else 'none'}"


SHIPPED = Path(__file__).parents[1] / "demo_models" / "calibration.json"  # measured for the demo pair


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
    pairs = table.setdefault(machine_key(), {})
    key = pair_key(target, drafter)
    pairs[key] = dict(fields) if replace else {**pairs.get(key, {}), **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return path
