"""A target sharded across processes with MLX's distributed backend (see ``sharded``)."""

from .peers import Peers, PeerLost
from .sharded import follow, sharded_engine

__all__ = ["Peers", "PeerLost", "follow", "sharded_engine"]
