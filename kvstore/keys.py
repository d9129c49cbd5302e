"""What a block key is: opaque bytes, 1..128 long. Checked by the codec and the store alike."""

from __future__ import annotations

from .errors import InvalidRequest

#: Longest block key in bytes. Chained hashes are 16-64 bytes; 128 leaves room
#: for a prefix while keeping a 1,000-key batch's keys well under 1 MiB.
MIN_KEY_LEN = 1
MAX_KEY_LEN = 128


def check_key(key: object) -> bytes:
    """Return ``key`` if it is a valid block key (bytes, 1..128 long).

    Raises:
        InvalidRequest: anything else.
    """
    if not isinstance(key, bytes) or not MIN_KEY_LEN <= len(key) <= MAX_KEY_LEN:
        what = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise InvalidRequest(f"a block key must be {MIN_KEY_LEN}..{MAX_KEY_LEN} bytes, got {what}")
    return key
