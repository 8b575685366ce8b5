"""A target sharded across ranks: the driver's engine and the followers' replay loop.

Every rank holds a tensor-parallel shard of the target (mlx-lm's ``model.shard``) and runs
the same state machine on the same plans, so every target forward's collectives line up.
The driver (rank 0) alone takes requests, holds the drafter, and cuts the plans: which
requests arrive or are cancelled before each step. Given the plans, admissions, preempts,
gates and re-arms follow on every rank from the same pure guards; the per-step
fingerprint check turns any drift into a loud ``PeerLost``.
"""

from __future__ import annotations

import structlog

from ...runtime.config import EngineConfig
from ...runtime.engine import Engine
from ...kernels.build import make_drafter, new_core, new_engine
from ...kernels.pair import load_pair
from ...kernels.models import LoadedModel, demo_pair, load
from ...runtime.plan import Plan
from .peers import Peers, PeerLost, is_peer_failure
from .relay import EchoDrafter, RelayDrafter
from .wire import decode_hello, decode_plan, encode_hello, encode_plan

log = structlog.get_logger(__name__)
REMOTE_DRAFTER = "drafter on the driver"  # a follower's drafter source: speculation is on


def unshardable(target: LoadedModel, n: int) -> str | None:
    """Why ``target`` cannot be split across ``n`` ranks, or None when it can."""
    model = target.model
    if not hasattr(model, "shard"):
        return (f"{target.name}: mlx-lm has no tensor-parallel shard() for "
                f"model type {getattr(model, 'model_type', '?')!r}")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(model.args, field, None)
        if value is not None and value % n:
            return f"{target.name}: {field}={value} does not split across {n} ranks"
    return None


def shard_target(target: LoadedModel, peers: Peers) -> None:
    """Split the target's attention heads and MLP across the ranks, in place."""
    why = unshardable(target, peers.size)
    if why is not None:
        raise ValueError(why)
    target.model.shard(peers.group)
    import mlx.core as mx
    mx.eval(target.model.parameters())


class DriverLink:
    """The engine's lockstep hook on rank 0: each plan goes to the followers first."""

    def __init__(self, peers: Peers):
        self.peers = peers

    def publish(self, plan: Plan, fingerprint: str) -> None:
        self.peers.send_bytes(encode_plan(plan, fingerprint))

    @staticmethod
    def is_fatal(exc: BaseException) -> bool:
        return is_peer_failure(exc)

    def close(self) -> None:
        """The engine thread ended: silence is expected from now on."""
        self.peers.stop()


def sharded_engine(model: str | None = None, draft_model: str | None = None, *,
                   peers: Peers | None = None, backend: str = "ring", timeout_s: float = 60.0,
                   **options) -> Engine | None:
    """On rank 0: a started Engine over the sharded target. On other ranks: replay the
    driver's plans until it closes its engine, then return None.

    Launch one process per rank with ``mlx.launch --backend ring -n 2 ...``."""
    if options.get("drafter") == "mtp":
        raise ValueError("an MTP head reads the target's KV cache, which tensor parallelism "
                         "splits across ranks; use a separate draft model with --distributed")
    peers = peers or Peers.init(backend, timeout_s)
    if not peers.driver:
        follow(peers, load(model if model is not None else demo_pair()["target"], dtype=options.get("dtype")))
        return None
    target, drafter, config = load_pair(model, draft_model, **options)
    shard_target(target, peers)
    peers.send_bytes(encode_hello(config, target.name, target.n_layers, target.vocab_size,
                                  drafter is not None and config.speculation))
    send_logits = config.verify == "rejection"

    def relay(source, runner, batch):
        return RelayDrafter(make_drafter(source, runner, batch), peers, send_logits)

    engine = new_engine(target, drafter, config, drafter_factory=relay, lockstep=DriverLink(peers))
    peers.watch(on_hang=engine._fail)
    log.info("sharded_engine", rank=peers.rank, ranks=peers.size, model=target.name)
    return engine


def follow(peers: Peers, target: LoadedModel) -> dict:
    """A follower rank: shard the target, then replay plans until the driver closes."""
    shard_target(target, peers)
    hello = decode_hello(peers.send_bytes(None))
    config: EngineConfig = hello["config"]  # the driver's: one set of guards everywhere
    if (hello["layers"], hello["vocab"]) != (target.n_layers, target.vocab_size):
        raise PeerLost(f"rank {peers.rank} loaded a different target than the driver's {hello['target']}")
    send_logits = config.verify == "rejection"

    def echo(source, runner, batch):
        return EchoDrafter(peers, target.vocab_size, send_logits)

    # the same core the driver's engine steps, fed the driver's plans instead of its own
    core = new_core(target, REMOTE_DRAFTER if hello["speculative"] else None, config,
                    drafter_factory=echo, fatal=is_peer_failure)
    peers.watch(on_hang=lambda error: None)
    log.info("follower_ready", rank=peers.rank, ranks=peers.size, model=target.name)
    steps = 0
    while not core.closed:
        plan, theirs = decode_plan(peers.send_bytes(None), target.tokenizer)
        mine = core.fingerprint()
        if mine != theirs:
            raise PeerLost(f"rank {peers.rank} left lock-step at step {steps}: driver {theirs}, here {mine}")
        core.apply(plan)  # releases memory on going idle, as the driver's engine does
        steps += 0 if core.closed else 1
    peers.stop()
    summary = {"rank": peers.rank, "steps": steps, "transitions": dict(core.counters.transitions)}
    log.info("follower_done", **summary)
    return summary
