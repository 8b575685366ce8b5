"""Calibrated width caps, keyed by model pair and machine (written by ``specbatch calibrate``)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def calibration_file() -> Path:
    base = os.environ.get("SPECBATCH_CALIBRATION") or Path.home() / ".cache" / "specbatch" / "calibration.json"
    return Path(base)


def machine_key() -> str:
    import mlx.core as mx
    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu-{mx.default_device()}"


def pair_key(target: str, drafter: str | None) -> str:
    return f"{Path(target).name}+{Path(drafter).name if drafter else 'none'}"


def lookup_cap(target: str, drafter: str | None) -> int | None:
    path = calibration_file()
    if not path.exists():
        return None
    try:
        table = json.loads(path.read_text())
        return int(table[machine_key()][pair_key(target, drafter)]["cap"])
    except (KeyError, ValueError, TypeError, json.JSONDecodeError):
        return None


def store_cap(target: str, drafter: str | None, cap: int, curve: dict) -> Path:
    path = calibration_file()
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(machine_key(), {})[pair_key(target, drafter)] = {"cap": cap, "curve": curve}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return path
