"""Token ids -> chained block keys, identical in every process and on every host.

A key names a whole prefix, not just its own tokens::

    k0 = H(root(seed), tokens[0:B], extra)
    ki = H(k(i-1),     tokens[iB:(i+1)B], extra)

so two prompts sharing a prefix share their leading keys, and a prefix lookup on the server
can stop at the first missing key. Only *full* blocks get a key: a partial block is never
stored. ``H`` hashes a canonical byte encoding (:func:`canonical_bytes`), never Python's
``hash()`` or pickle, so the keys do not depend on ``PYTHONHASHSEED``, the Python version or
the platform. (vLLM's prefix-cache hash needs ``PYTHONHASHSEED`` set for xxhash and pickles
tuples for sha256; its ``sha256_cbor`` option exists for the same cross-host reason.)

Algorithms: ``sha256`` (default, 32-byte keys) and ``xxh3_128`` (16-byte keys, several times
faster; not collision resistant against an adversary who controls prompts).
"""

from __future__ import annotations

import hashlib
import operator
import re
import struct
from collections.abc import Callable, Iterable, Sequence

import xxhash

__all__ = [
    "ALGORITHMS",
    "BlockHasher",
    "KeyChain",
    "canonical_bytes",
    "namespace_for",
]

_HashFn = Callable[[bytes], bytes]

ALGORITHMS: dict[str, tuple[_HashFn, int]] = {
    "sha256": (lambda data: hashlib.sha256(data).digest(), 32),
    "xxh3_128": (xxhash.xxh3_128_digest, 16),
}
"""Known hash algorithms: name -> (digest function, key size in bytes)."""

# Domain tags keep a block message from ever equalling a root or namespace message.
_ROOT_TAG = b"kvstore.root.v1\x00"
_BLOCK_TAG = b"kvstore.block.v1\x00"
_NAMESPACE_TAG = "kvstore.namespace.v1"

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def canonical_bytes(value: object) -> bytes:
    """A canonical, type-tagged encoding of ``value`` for hashing.

    Accepts None, bool, int, str, bytes-like and (nested) tuples/lists of those, numpy and torch
    integers and bools as the Python values they hold (``tolist()``: a tensor of ids is a list); dicts are
    encoded with their items sorted by encoded key. Floats are refused: ``0.1 + 0.2`` style
    rounding would make equal-looking extras hash differently on different hosts.

    Raises:
        TypeError: for any other type.
    """
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: object, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"S" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out += b"B" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, (tuple, list)):
        out += b"L" + struct.pack("<I", len(value))
        for item in value:
            _encode(item, out)
    elif isinstance(value, dict):
        items = sorted((canonical_bytes(k), canonical_bytes(v)) for k, v in value.items())
        out += b"D" + struct.pack("<I", len(items))
        for k, v in items:
            out += k + v
    elif hasattr(value, "tolist") and _integral(getattr(value, "dtype", None)):
        try:  # numpy and torch integers and bools: as the Python values they hold
            held = value.tolist()  # (np.int64(7) is 7, a tensor of ids a list of ints)
        except (RuntimeError, NotImplementedError):  # (a meta or sparse tensor)
            raise TypeError(f"cannot hash a {type(value).__name__} canonically: {value!r}") from None
        _encode(held, out)
    else:
        raise TypeError(f"cannot hash a {type(value).__name__} canonically: {value!r}")


def _integral(dtype: object) -> bool:
    """A numpy or torch integer or bool dtype (a datetime64 would hash as its count of units)."""
    kind = getattr(dtype, "kind", None)  # numpy's, whatever the byte order
    return kind in ("b", "i", "u") if kind is not None else bool(re.fullmatch(r"torch\.(u?int\d+|bool)", str(dtype)))


def whole_number(value: object, name: str) -> int:
    """``value`` as an int >= 1, numpy integers too; a ValueError naming ``name`` for anything else
    (2.0 from a ``/``, True, "4"), raised where it comes in rather than at the first key or slice."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else 0  # type: ignore[arg-type]
    except TypeError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return n


class BlockHasher:
    """Computes the key chain of a token sequence for one block size and algorithm.

    Args:
        block_size: tokens per key (the *offloaded* block size).
        algo: a name from :data:`ALGORITHMS`.
        seed: salts the root of every chain (e.g. a deployment secret); any value
            :func:`canonical_bytes` accepts.

    Raises:
        ValueError: unknown algorithm or a block size below 1.
    """

    def __init__(self, block_size: int, *, algo: str = "sha256", seed: object = b"") -> None:
        block_size = whole_number(block_size, "block_size")
        try:
            self._digest, self.key_size = ALGORITHMS[algo]
        except KeyError:
            raise ValueError(f"unknown hash algorithm {algo!r}; known: {sorted(ALGORITHMS)}") from None
        self.algo = algo
        self.block_size = block_size
        self.root: bytes = self._digest(_ROOT_TAG + canonical_bytes(seed))

    def block_key(self, parent: bytes | None, tokens: Sequence[int], extra: object = None) -> bytes:
        """The key of one full block whose predecessor has key ``parent`` (None: first block).

        Raises:
            ValueError: ``tokens`` is not exactly one block, a token is not an int64, or
                ``parent`` is not a key of this hasher.
        """
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != self.key_size):
            raise ValueError(f"parent must be a {self.key_size}-byte key of this hasher (or None), got {parent!r}")
        return self._key(self.root if parent is None else parent, tokens, canonical_bytes(extra))

    def keys(self, token_ids: Sequence[int], extra: object = None) -> list[bytes]:
        """Keys of every full block of ``token_ids``; a trailing partial block has none."""
        return KeyChain(self, extra, token_ids).keys

    def chain(self, extra: object = None, token_ids: Iterable[int] = ()) -> KeyChain:
        """An incremental chain, to extend as tokens arrive."""
        return KeyChain(self, extra, token_ids)

    def _key(self, parent: bytes, tokens: Sequence[int], extra_bytes: bytes) -> bytes:
        if len(tokens) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(tokens)}")
        try:
            packed = struct.pack(f"<{len(tokens)}q", *tokens)
        except struct.error as exc:
            raise ValueError(f"token ids must be int64 integers: {exc}") from None
        return self._digest(_BLOCK_TAG + parent + packed + extra_bytes)


class KeyChain:
    """The growing key chain of one request: feed tokens, get keys for blocks as they fill.

    Splitting the same tokens differently over :meth:`extend` calls gives the same keys.
    """

    def __init__(self, hasher: BlockHasher, extra: object = None, token_ids: Iterable[int] = ()) -> None:
        self.hasher = hasher
        self._extra = canonical_bytes(extra)
        self._keys: list[bytes] = []
        self._pending: list[int] = []
        self.extend(token_ids)

    @property
    def keys(self) -> list[bytes]:
        """A copy of the keys of all full blocks so far."""
        return list(self._keys)

    @property
    def num_tokens(self) -> int:
        """All tokens fed so far, the partial tail included."""
        return len(self._keys) * self.hasher.block_size + len(self._pending)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: int) -> bytes:
        return self._keys[index]

    def slice(self, start: int, stop: int) -> list[bytes]:
        """Keys ``start:stop`` without copying the whole chain."""
        return self._keys[start:stop]

    def extend(self, token_ids: Iterable[int]) -> list[bytes]:
        """Append tokens; returns the keys of the blocks they completed.

        Raises:
            ValueError: a token is not an int64 (the chain is left unchanged).
        """
        new_tokens = [_token(token) for token in token_ids]
        pending = self._pending + new_tokens
        size = self.hasher.block_size
        added: list[bytes] = []
        parent = self._keys[-1] if self._keys else self.hasher.root
        full = len(pending) - len(pending) % size
        for start in range(0, full, size):
            parent = self.hasher._key(parent, pending[start : start + size], self._extra)
            added.append(parent)
        self._pending = pending[full:]
        self._keys.extend(added)
        return added


def _token(token: object) -> int:
    try:
        value = operator.index(token)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"token ids must be integers, got {token!r}") from None
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"token id {value} does not fit in int64")
    return value


_DTYPE_SHORT = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8e4m3",
    "float8_e4m3fnuz": "fp8e4m3fnuz",
    "float8_e5m2": "fp8e5m2",
    "float8_e5m2fnuz": "fp8e5m2fnuz",
    "int8": "int8",
    "uint8": "uint8",
}
# torch's other names for the same dtypes (``torch.half is torch.float16``): one namespace for both.
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "short": "int16", "int": "int32",
                  "long": "int64", "chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128"}


def _short_model(model: str) -> str:
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9._-]+", "-", name).strip("-")[:40] or "model"


def namespace_for(
    model: str,
    dtype: object,
    kv_layout: str,
    tp_rank: int,
    block_size: int,
    *,
    gpu_block_size: int | None = None,
    tp_size: int = 1,
    algo: str = "sha256",
    **extra: object,
) -> str:
    """A short, readable namespace that also fingerprints everything the payload depends on.

    ``"meta-llama/Meta-Llama-3-8B", torch.bfloat16, "NHD", 0, 48`` gives something like
    ``"meta-llama-3-8b/bf16/tp0/b48-1a2b3c4d"``: the readable part is for humans and
    ``redis-cli --scan``; the 8-hex fingerprint covers the full model name, dtype, layout,
    TP rank and size, block size, GPU block size, hash algorithm and any ``extra`` (model
    revision, quantization, ...), so two configurations whose payloads differ never share a
    namespace -- as long as every one of them is passed: an engine that loads a payload of
    another layout fails the load and deletes the block (:class:`~kvstore.engine.transfer.TransferExecutor`),
    and two engines sharing a namespace that way delete each other's blocks.

    Args:
        model: model name or path.
        dtype: KV-cache dtype (a ``torch.dtype`` or its name).
        kv_layout: any string naming the cache layout (e.g. ``"NHD"`` or a shape).
        tp_rank: tensor-parallel rank whose heads the blocks hold.
        block_size: offloaded block size in tokens.
        gpu_block_size: the engine's GPU (paged-cache) block size in tokens: a payload holds
            ``block_size // gpu_block_size`` GPU blocks, laid out by that factor
            (:class:`~kvstore.engine.transfer.PagedKVTransfer`). An ``extra`` field of that name, as it was
            passed before it had a parameter of its own; None leaves it out. Give it wherever engines
            with different GPU block sizes share a store.
        tp_size: tensor-parallel world size.
        algo: the key hash algorithm in use.
        extra: further fields that change the payload; values as :func:`canonical_bytes`.
    """
    dtype_name = str(dtype).removeprefix("torch.")
    dtype_name = _DTYPE_ALIASES.get(dtype_name, dtype_name)
    dtype_short = _DTYPE_SHORT.get(dtype_name, re.sub(r"[^a-z0-9]+", "", dtype_name.lower()))
    if gpu_block_size is not None:  # (one of the extra fields, as a caller could pass it before it was named)
        extra = {**extra, "gpu_block_size": gpu_block_size}
    fields = (_NAMESPACE_TAG, model, dtype_name, kv_layout, tp_rank, tp_size, block_size, algo, extra)
    fingerprint = hashlib.sha256(canonical_bytes(fields)).hexdigest()[:8]
    return f"{_short_model(model)}/{dtype_short}/tp{tp_rank}/b{block_size}-{fingerprint}"
