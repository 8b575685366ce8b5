"""The acceptance book: each live row's acceptance by draft position, as the policy reads it.

Every row starts from the calibration's prior for its temperature band and follows its own
verify rounds (an EWMA); a plain round moves it back toward the prior, so a stream that
stopped drafting tries again. A lone row's prompt-lookup drafts are booked apart: they say
nothing of the drafter's.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from .policy import Prior, RowState, lookup_prior

# Weight of the latest round in a row's acceptance: 0.3 swung a 0.3-accepting row to plain and back;
# at 0.1, a width-1 row accepting ~0.37 fell to plain on runs of rejections (0.92-0.97 of always drafting).
EWMA = 0.05
RELAX = 0.1  # a plain round moves a row's acceptance this far back toward the prior
LOOKUP_EWMA = 0.2
LOOKUP_RELAX = 0.02  # a round without a lookup moves a row's lookup acceptance back toward the prior


@attrs.define
class AcceptanceBook:
    """Each live row's acceptance by draft position: an EWMA over its recent rounds,
    starting from the prior. Rows are keyed by request id and forgotten when they leave."""

    prior: Prior = attrs.field(factory=Prior)
    depth: int = 8
    rates: dict = attrs.field(factory=dict)  # request id -> list of per-position rates
    lookups: dict = attrs.field(factory=dict)  # request id -> the same, of its prompt-lookup drafts
    # temperature -> the prior's rates by position: a row that only decodes plain reads them every step
    priors: dict = attrs.field(factory=dict, repr=False)

    def row(self, request) -> RowState:
        t = request.params.temperature
        rates = self.rates.get(request.id)
        if rates is None:
            rates = self.priors.get(t)
            if rates is None:
                rates = self.priors[t] = tuple(self.prior.at(i, t) for i in range(1, self.depth + 1))
        return RowState(rates, t, self.lookups.get(request.id, (lookup_prior(t),)))

    def rows(self, requests) -> list[RowState]:
        return [self.row(r) for r in requests]

    def observe(self, requests, drafted: int, accepted: Sequence[int], lookup: bool = False) -> None:
        """A verify round: each row accepted ``accepted[i]`` of ``drafted`` drafts (``lookup``:
        prompt-lookup drafts, kept apart from the drafter's). Positions up to the accepted
        count saw an accept, the next one a reject, later ones nothing."""
        table, rate = (self.lookups, LOOKUP_EWMA) if lookup else (self.rates, EWMA)
        for request, got in zip(requests, accepted):
            row = self.row(request)
            rates = list(row.lookup if lookup else row.acceptance)
            rates += rates[-1:] * (min(drafted, self.depth) - len(rates))
            for position in range(1, min(drafted, self.depth) + 1):
                if position > got + 1:
                    break
                seen = 1.0 if position <= got else 0.0
                rates[position - 1] += rate * (seen - rates[position - 1])
            table[request.id] = rates
        if not lookup:
            self._relax_lookups(requests)

    def relax(self, requests) -> None:
        """A plain round: each row's acceptance drifts back toward the prior. A plain round
        observes nothing, so without this a few rejections decided plain for the rest of a
        stream (7 speculative rounds of 63 at width 1, where always drafting gained 1.23x)."""
        for request in requests:
            rates, t = self.rates.get(request.id), request.params.temperature
            if rates is not None:
                self.rates[request.id] = [r + RELAX * (self.prior.at(i, t) - r) for i, r in enumerate(rates, 1)]
        self._relax_lookups(requests)

    def _relax_lookups(self, requests) -> None:
        """A round without a lookup: a row whose lookups stopped paying tries them again later."""
        for request in requests:
            rates, prior = self.lookups.get(request.id), lookup_prior(request.params.temperature)
            if rates is not None:
                self.lookups[request.id] = [r + LOOKUP_RELAX * (prior - r) for r in rates]

    def keep(self, requests) -> None:
        """Forget rows no longer live."""
        live = {r.id for r in requests}
        if live.issuperset(self.rates) and live.issuperset(self.lookups):
            return
        self.rates = {i: v for i, v in self.rates.items() if i in live}
        self.lookups = {i: v for i, v in self.lookups.items() if i in live}
