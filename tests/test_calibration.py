"""Calibration keys: this CPU model's entry first, then its ISA class's; the user's file before the shipped one."""

from __future__ import annotations

import json

import pytest

from specbatch.kernels import calibration
from specbatch.kernels.calibration import cpu_model, lookup, machine_key, machine_keys, pair_key, store_fields, store_key

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
"""


def test_the_cpu_model_is_the_first_processors_vendor_family_and_model():
    assert cpu_model(CPUINFO) == "AuthenticAMD-25-17"
    assert cpu_model("processor\t: 0\nvendor_id\t: AuthenticAMD\n") == ""  # no family / model: no key of its own
    assert cpu_model("") == ""


def test_lookups_try_the_cpu_model_then_the_isa_class(monkeypatch):
    monkeypatch.setattr(calibration, "cpu_model", lambda cpuinfo=None: "Vendor-1-2")
    assert machine_keys() == [f"{machine_key()}-Vendor-1-2", machine_key()] and store_key() == machine_keys()[0]
    monkeypatch.setattr(calibration, "cpu_model", lambda cpuinfo=None: "")
    assert machine_keys() == [machine_key()] == [store_key()]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """(the user's calibration file, the shipped one), both empty, this CPU model 'Vendor-1-2'."""
    user, shipped = tmp_path / "user.json", tmp_path / "shipped.json"
    monkeypatch.setenv("SPECBATCH_CALIBRATION", str(user))
    monkeypatch.setattr(calibration, "SHIPPED", shipped)
    monkeypatch.setattr(calibration, "cpu_model", lambda cpuinfo=None: "Vendor-1-2")
    return user, shipped


def _write(path, entries: dict) -> None:
    path.write_text(json.dumps({key: {pair_key("t", "d"): {"cap": cap}} for key, cap in entries.items()}))


def test_the_cpu_models_entry_wins_and_the_isa_class_is_the_fallback(files):
    user, shipped = files
    specific, isa = machine_keys()
    _write(shipped, {isa: 1})
    assert lookup("t", "d") == 1
    _write(shipped, {isa: 1, specific: 2, f"{isa}-Other-9-9": 3})
    assert lookup("t", "d") == 2
    _write(user, {isa: 4})  # the user's own calibration, even of the class, before anything shipped
    assert lookup("t", "d") == 4
    _write(user, {isa: 4, specific: 5})
    assert lookup("t", "d") == 5


def test_a_calibration_is_stored_under_the_cpu_model(files):
    user, _ = files
    store_fields("t", "d", {"cap": 7})
    table = json.loads(user.read_text())
    assert list(table) == [store_key()] and table[store_key()][pair_key("t", "d")] == {"cap": 7}
    assert lookup("t", "d") == 7
