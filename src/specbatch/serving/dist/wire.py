"""Plans and the startup handshake on the wire: JSON, one message per step.

A plan message carries the driver's fingerprint of its scheduling state before the step;
a follower compares it with its own and stops with ``PeerLost`` if they differ, so a rank
that drifted out of lock-step fails loudly instead of emitting different tokens.
"""

from __future__ import annotations

import json

import attrs

from ...runtime.config import EngineConfig
from ...runtime.plan import Plan
from ...runtime.request import Request
from ...runtime.params import SamplingParams


def encode_plan(plan: Plan, fingerprint: str) -> bytes:
    arrivals = [{"id": r.id, "prompt": r.prompt, "params": attrs.asdict(r.params)} for r in plan.arrivals]
    return json.dumps({"arrivals": arrivals, "cancels": list(plan.cancels), "closing": plan.closing,
                       "abandon": plan.abandon, "more_coming": plan.more_coming,
                       "fingerprint": fingerprint}, separators=(",", ":")).encode()


def decode_plan(data: bytes, tokenizer) -> tuple[Plan, str]:
    msg = json.loads(data)
    arrivals = []
    for a in msg["arrivals"]:
        # the driver's id: cancels name it
        arrivals.append(Request.create(a["prompt"], SamplingParams(**a["params"]), tokenizer, a["id"]))
    plan = Plan(tuple(arrivals), tuple(msg["cancels"]), closing=msg["closing"],
                abandon=msg["abandon"], more_coming=msg["more_coming"])
    return plan, msg["fingerprint"]


def encode_hello(config: EngineConfig, target: str, layers: int, vocab: int, speculative: bool) -> bytes:
    """What followers must share with the driver: its config and the target's shape."""
    return json.dumps({"config": attrs.asdict(config), "target": target, "layers": layers,
                       "vocab": vocab, "speculative": speculative}).encode()


def decode_hello(data: bytes) -> dict:
    msg = json.loads(data)
    msg["config"] = EngineConfig(**msg["config"])
    return msg
