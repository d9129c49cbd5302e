"""kvstore: a network KV-cache block store for prefill/decode disaggregated LLM serving.

The server lives in :mod:`kvstore.server`, the client in :mod:`kvstore.client`,
the engine-side pieces (hashing, offload scheduling, tensor transfer) in
:mod:`kvstore.engine`. This package itself imports neither asyncio servers nor torch.
"""

from .errors import (
    BlockSizeError,
    CapacityError,
    IntegrityError,
    InternalError,
    InvalidRequest,
    KVStoreError,
    NotFound,
    ProtocolError,
    RequestTimeout,
    ServerError,
    TooLarge,
    TransportError,
    Unauthorized,
    Unavailable,
)

__version__ = "0.1.0"

__all__ = [
    "BlockSizeError",
    "CapacityError",
    "IntegrityError",
    "InternalError",
    "InvalidRequest",
    "KVStoreError",
    "NotFound",
    "ProtocolError",
    "RequestTimeout",
    "ServerError",
    "TooLarge",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "__version__",
]
