"""What kvstore writes to Redis: key names and the value header (``docs/redis-layout.md``).

Pure functions, no I/O: the tier writes and reads through them, tests and tools decode with them.
The page and this module change together.
"""

from __future__ import annotations

import json
import struct
from typing import Iterable
from urllib.parse import quote

import xxhash

KEY_PREFIX = "kvstore:"
NS_RECORD_PREFIX = "kvstore-ns:"  # outside "kvstore:*", so a scan of blocks meets only strings
MAGIC = b"KVB"
LAYOUT_VERSION = 1
#: magic, layout version, key tag (see :func:`key_tag`), xxh3-64 of the block as the client computed it
HEADER = struct.Struct("!3sBIQ")
HEADER_SIZE = HEADER.size  # 16
# Namespace characters kept as they are in key names; the rest is %-encoded, so a
# namespace can never add a ':' (ambiguous names), '{' (a hash tag pinning it to
# one cluster slot) or a glob character (SCAN MATCH patterns) to a key.
_NS_SAFE = "/=+,@"


def ns_part(ns: str) -> str:
    """The namespace as it appears in Redis key names."""
    return quote(ns, safe=_NS_SAFE)


def block_key(ns: str, key: bytes) -> str:
    """``kvstore:<namespace>:<hex key>``: one Redis string per block."""
    return f"{KEY_PREFIX}{ns_part(ns)}:{key.hex()}"


def ns_record_key(ns: str) -> str:
    """``kvstore-ns:<namespace>``: a hash describing the namespace."""
    return f"{NS_RECORD_PREFIX}{ns_part(ns)}"


def key_tag(name: str) -> int:
    """The header's tag of the Redis key ``name`` a value is written under (32 bits of its
    xxh3-64, never 0). The checksum covers the block alone, so a value copied or renamed to
    another key would pass it; the tag tells. 0 in a header: written before tags (not checked)."""
    return xxhash.xxh3_64_intdigest(name.encode()) & 0xFFFFFFFF or 1


def encode_value(data: Iterable[memoryview | bytes], checksum: int, tag: int) -> bytes:
    """Header + block bytes: the one copy a Redis value needs (its argument must be one buffer)."""
    return b"".join([HEADER.pack(MAGIC, LAYOUT_VERSION, tag, checksum), *data])


def decode_value(value: bytes) -> tuple[memoryview, int, int] | None:
    """``(block, checksum, tag)`` from a stored value; ``None`` if it is not a kvstore block value."""
    if len(value) < HEADER_SIZE:
        return None
    magic, version, tag, checksum = HEADER.unpack_from(value)
    if magic != MAGIC or version != LAYOUT_VERSION:
        return None
    return memoryview(value)[HEADER_SIZE:], checksum, tag


def misplaced(tag: int, name: str) -> bool:
    """A value whose tag names another key (copied or renamed inside Redis)."""
    return tag != 0 and tag != key_tag(name)


def namespace_record(ns: str, ttl_s: int) -> dict[str, str]:
    """The static fields of a namespace's record: enough for ``HGETALL`` to explain the keys."""
    return {
        "namespace": ns,
        "key_pattern": f"{KEY_PREFIX}{ns_part(ns)}:<hex key>",
        "segments": json.dumps(ns.split("/")),  # e.g. ["llama3-8b", "bf16", "tp0"]: model, dtype, rank...
        "value_header": f"{HEADER_SIZE} bytes: magic 'KVB', version {LAYOUT_VERSION}, key tag u32, "
                        "xxh3-64 u64 (big-endian)",
        "ttl_s": str(ttl_s),
    }
