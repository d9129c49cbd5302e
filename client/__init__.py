"""The kvstore client library: ``AsyncKVClient`` (asyncio) and ``KVClient`` (blocking).

Neither imports torch; tensor helpers live in :mod:`kvstore.engine.transfer`.
"""

from kvstore.errors import KVStoreError

from .aio import AsyncKVClient, PutResult
from .sync import KVClient

__all__ = ["AsyncKVClient", "KVClient", "KVStoreError", "PutResult"]
