"""The draft-length schedule: how many tokens to draft at each batch width and temperature.

Speculation pays where a verify's extra positions cost less than the tokens they accept;
both sides move with the batch width (wider batches read more per verify position) and
with temperature (sampled rows accept less). ``specbatch calibrate`` measures, for each
width and temperature band, the draft length ``k`` with the most throughput on this
machine (``k = 0``: decode plain) and stores the table; the engine reads it every round.

Vocabulary: a *band* is a temperature range ``(previous band's max, max_temperature]``;
a batch uses the band of its hottest row; a width between two measured widths takes the
lower one's ``k``, a width past the widest measured takes the widest's.
"""

from __future__ import annotations

import bisect

import attrs


def _ascending(inst, attr, value) -> None:
    if list(value) != sorted(value) or len(set(value)) != len(value):
        raise ValueError(f"{attr.name} must be strictly ascending, got {value!r}")


@attrs.frozen
class Band:
    max_temperature: float
    k: tuple[int, ...] = attrs.field(converter=tuple)  # k[i]: draft length at widths[i]

    def __attrs_post_init__(self) -> None:
        if any(not isinstance(k, int) or k < 0 for k in self.k):
            raise ValueError(f"draft lengths must be integers >= 0, got {self.k!r}")


@attrs.frozen
class DraftSchedule:
    widths: tuple[int, ...] = attrs.field(converter=tuple, validator=_ascending)
    bands: tuple[Band, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not self.widths or self.widths[0] != 1:
            raise ValueError(f"a schedule starts at width 1, got widths {self.widths!r}")
        if any(len(b.k) != len(self.widths) for b in self.bands):
            raise ValueError("every band needs one draft length per width")
        _ascending(self, attrs.fields(DraftSchedule).bands, [b.max_temperature for b in self.bands])

    def draft_length(self, width: int, temperature: float) -> int:
        """``k`` for a batch of ``width`` rows whose hottest row samples at ``temperature``."""
        temps = [b.max_temperature for b in self.bands]
        band = bisect.bisect_left(temps, temperature - 1e-9)
        if band == len(self.bands) or width < 1:
            return 0  # hotter than every measured band: speculation was not shown to pay
        return self.bands[band].k[bisect.bisect_right(self.widths, width) - 1]

    def cap(self) -> int:
        """The widest width with ``k > 0`` in the coldest band (1 when none: never 0, which
        would mean uncapped)."""
        ks = self.bands[0].k if self.bands else ()
        return max([w for w, k in zip(self.widths, ks) if k > 0], default=1)

    def max_k(self) -> int:
        return max([k for b in self.bands for k in b.k], default=0)

    def to_json(self) -> dict:
        return {"widths": list(self.widths),
                "bands": [{"max_temperature": b.max_temperature, "k": list(b.k)} for b in self.bands]}

    @classmethod
    def from_json(cls, data: dict) -> "DraftSchedule":
        return cls(data["widths"], [Band(float(b["max_temperature"]), b["k"]) for b in data["bands"]])
