"""Engine-side pieces: block hashing, the offload scheduler and (torch) tensor transfer.

``hashing`` and ``offload`` are pure Python; :mod:`kvstore.engine.transfer` imports torch and
is therefore not imported here -- import it explicitly. See ``docs/engine.md``.
"""

from kvstore.engine.hashing import ALGORITHMS, BlockHasher, KeyChain, canonical_bytes, namespace_for
from kvstore.engine.offload import Finished, LoadJob, LookupFn, OffloadScheduler, StoreJob

__all__ = [
    "ALGORITHMS",
    "BlockHasher",
    "Finished",
    "KeyChain",
    "LoadJob",
    "LookupFn",
    "OffloadScheduler",
    "StoreJob",
    "canonical_bytes",
    "namespace_for",
]
