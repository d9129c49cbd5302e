"""Which server holds a key: rendezvous (highest-random-weight) hashing.

Each key goes to the server whose ``xxh3_64(key, seed=server)`` is highest, so
adding a server moves only the keys it now wins (about 1/N of them) and removing
one moves only its own keys; every client computes the same placement with no
coordination -- from the address strings as written: ``localhost:7600`` and
``127.0.0.1:7600`` name the same server but place keys differently, so prefill
and decode engines must list their servers spelled alike (the order is free). See Thaler & Ravishankar, "Using name-based mappings to increase
hit rates" (1998).
"""

from __future__ import annotations

from typing import Sequence

import xxhash


class Ring:
    def __init__(self, nodes: Sequence[str]) -> None:
        if len(set(nodes)) != len(nodes):
            raise ValueError("server addresses must be distinct")
        self.nodes = list(nodes)
        # A node's seed comes from its address, so placement is stable across clients and restarts.
        self._seeds = [xxhash.xxh3_64_intdigest(n.encode()) for n in self.nodes]

    def node_of(self, key: bytes) -> int:
        """Index of the server that holds ``key``."""
        if len(self._seeds) == 1:
            return 0
        h = xxhash.xxh3_64_intdigest
        scores = [h(key, seed) for seed in self._seeds]
        return scores.index(max(scores))
