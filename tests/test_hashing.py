"""Block keys: deterministic across processes, chained, salted by extras, two algorithms."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.engine.hashing import ALGORITHMS, BlockHasher, KeyChain, canonical_bytes, namespace_for

TOKENS = [(i * 7919) % 50000 for i in range(100)]

_CHILD = """
import json, sys
from kvstore.engine.hashing import BlockHasher, namespace_for
tokens = json.loads(sys.argv[1])
out = {}
for algo in ("sha256", "xxh3_128"):
    h = BlockHasher(16, algo=algo, seed="s")
    out[algo] = [k.hex() for k in h.keys(tokens, extra=("lora", 3, b"mm"))]
out["ns"] = namespace_for("org/Model-X", "torch.bfloat16", "NHD", 1, 48, tp_size=2)
out["hash_of_str"] = hash("x")
print(json.dumps(out))
"""


def _local_keys(tokens: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for algo in ("sha256", "xxh3_128"):
        h = BlockHasher(16, algo=algo, seed="s")
        out[algo] = [k.hex() for k in h.keys(tokens, extra=("lora", 3, b"mm"))]
    out["ns"] = namespace_for("org/Model-X", "torch.bfloat16", "NHD", 1, 48, tp_size=2)
    return out


def test_same_keys_in_processes_with_different_hash_seeds() -> None:
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(TOKENS)], env=env, capture_output=True, text=True, check=True
        )
        results.append(json.loads(proc.stdout))
    assert results[0]["hash_of_str"] != results[1]["hash_of_str"]  # the seeds really differ
    local = _local_keys(TOKENS)
    for res in results:
        assert {k: res[k] for k in local} == local
    assert len(local["sha256"]) == 100 // 16


def test_known_answer() -> None:
    # The encoding is a contract between hosts and versions: a change here strands stored data.
    h = BlockHasher(4)
    keys = h.keys([1, 2, 3, 4, 5, 6, 7, 8])
    assert keys[0].hex() == KNOWN_SHA256_K0
    # ... and it is the documented encoding: tag, parent key, int64 LE tokens, encoded extra
    root = hashlib.sha256(b"kvstore.root.v1\x00" + b"B\x00\x00\x00\x00").digest()
    assert h.root == root
    assert keys[0] == hashlib.sha256(b"kvstore.block.v1\x00" + root + struct.pack("<4q", 1, 2, 3, 4) + b"N").digest()
    assert keys[1] == h.block_key(keys[0], [5, 6, 7, 8])
    assert BlockHasher(4, algo="xxh3_128").keys([1, 2, 3, 4])[0].hex() == KNOWN_XXH3_K0


def test_canonical_bytes_is_the_documented_encoding() -> None:
    """docs/engine.md spells the encoding out byte by byte for engines in other languages."""
    from kvstore.engine.hashing import canonical_bytes

    assert canonical_bytes(None) + canonical_bytes(True) + canonical_bytes(False) == b"NTF"
    assert [canonical_bytes(n) for n in (0, 255, -1)] == [b"I\x01\x00\x00\x00\x00", b"I\x02\x00\x00\x00\x00\xff",
                                                           b"I\x01\x00\x00\x00\xff"]
    assert canonical_bytes("é") == b"S\x02\x00\x00\x00\xc3\xa9" and canonical_bytes(b"") == b"B\x00\x00\x00\x00"
    assert canonical_bytes(("a", [1])) == b"L\x02\x00\x00\x00" + canonical_bytes("a") + b"L\x01\x00\x00\x00" + canonical_bytes(1)
    assert canonical_bytes({"b": 1, "a": 2}) == (b"D\x02\x00\x00\x00" + canonical_bytes("a") + canonical_bytes(2)
                                                 + canonical_bytes("b") + canonical_bytes(1))


KNOWN_SHA256_K0 = "22a497408b44d5dcaddde002f38d3b3eae63886dc492b8be2e9e562d3ecb0fb4"
KNOWN_XXH3_K0 = "970404cb0954e22e5d156b82bfae6c0b"


def test_changing_any_token_changes_its_block_and_every_later_key() -> None:
    h = BlockHasher(8)
    base = h.keys(TOKENS)
    for pos in range(0, 96, 5):
        changed = list(TOKENS)
        changed[pos] += 1
        keys = h.keys(changed)
        block = pos // 8
        assert keys[:block] == base[:block]
        assert all(a != b for a, b in zip(keys[block:], base[block:]))


def test_shared_prefix_shares_leading_keys_only() -> None:
    h = BlockHasher(10)
    a = h.keys(TOKENS[:60])
    b = h.keys(TOKENS[:35] + [1] * 25)
    assert a[:3] == b[:3] and a[3] != b[3]


def test_partial_block_has_no_key() -> None:
    h = BlockHasher(16)
    assert h.keys(TOKENS[:15]) == []
    assert h.keys(TOKENS[:47]) == h.keys(TOKENS[:32])
    assert len(h.keys(TOKENS[:48])) == 3


@pytest.mark.parametrize(
    "extra",
    [("lora", 1), ("lora", 2), ["mm", b"\x00" * 32], {"lora": "a"}, "1", 1, b"1", None],
)
def test_extra_keys_change_every_key(extra: object) -> None:
    h = BlockHasher(16)
    others = [("lora", 1), ("lora", 2), ["mm", b"\x00" * 32], {"lora": "a"}, "1", 1, b"1", None]
    mine = h.keys(TOKENS, extra=extra)
    for other in others:
        if canonical_bytes(other) == canonical_bytes(extra):
            assert h.keys(TOKENS, extra=other) == mine
        else:
            assert all(a != b for a, b in zip(h.keys(TOKENS, extra=other), mine))


def test_seed_salts_the_chain() -> None:
    assert BlockHasher(16, seed="a").keys(TOKENS)[0] != BlockHasher(16, seed="b").keys(TOKENS)[0]


def test_algorithms() -> None:
    sha = BlockHasher(16).keys(TOKENS)
    xxh = BlockHasher(16, algo="xxh3_128").keys(TOKENS)
    assert {len(k) for k in sha} == {32} and {len(k) for k in xxh} == {16}
    assert set(ALGORITHMS) == {"sha256", "xxh3_128"}
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher(16, algo="md5")
    for bad in (0, 2.5, "4", None, True):  # (2.5 failed at the first key, "4" with a bare TypeError)
        with pytest.raises(ValueError, match="integer >= 1"):
            BlockHasher(bad)  # type: ignore[arg-type]
    assert BlockHasher(np.int64(16)).keys(TOKENS) == sha  # (numpy integers are integers)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), max_size=70),
    cuts=st.lists(st.integers(0, 70), max_size=6),
    algo=st.sampled_from(sorted(ALGORITHMS)),
)
def test_incremental_chain_equals_one_shot(tokens: list[int], cuts: list[int], algo: str) -> None:
    h = BlockHasher(7, algo=algo)
    chain = KeyChain(h, extra="x")
    got: list[bytes] = []
    prev = 0
    for cut in sorted(min(c, len(tokens)) for c in cuts) + [len(tokens)]:
        got += chain.extend(tokens[prev:cut])
        prev = cut
    assert got == chain.keys == h.keys(tokens, extra="x")
    assert chain.num_tokens == len(tokens) and len(chain) == len(tokens) // 7


def test_bad_tokens_and_extras_are_refused() -> None:
    h = BlockHasher(2)
    with pytest.raises(ValueError):
        h.keys([1, 2**63])
    with pytest.raises(ValueError):
        h.keys([1, "2"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        h.block_key(None, [1, 2, 3])
    first = h.block_key(None, [1, 2])
    assert h.block_key(first, [3, 4]) == h.keys([1, 2, 3, 4])[1]
    for parent in (first.hex(), first[:16], bytearray(first)):  # (a str: bare TypeError; a short key: taken)
        with pytest.raises(ValueError, match="parent must be a 32-byte key"):
            h.block_key(parent, [3, 4])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        h.keys([1, 2], extra=0.5)
    chain = h.chain(token_ids=[1])
    with pytest.raises(ValueError):
        chain.extend([2, None])  # type: ignore[list-item]
    assert chain.num_tokens == 1  # unchanged by the refused call
    assert canonical_bytes(1) != canonical_bytes("1") != canonical_bytes(b"1")
    assert canonical_bytes(True) != canonical_bytes(1)
    # a numpy or torch integer is the int it holds (np.int64 was refused), a float stays refused
    import numpy as np

    torch = pytest.importorskip("torch")
    assert canonical_bytes((np.int64(7), torch.tensor(-3))) == canonical_bytes((7, -3))
    assert h.keys([1, 2], extra=np.int32(5)) == h.keys([1, 2], extra=5)
    assert canonical_bytes(torch.tensor([5, 6])) == canonical_bytes(np.array([5, 6])) == canonical_bytes([5, 6])
    assert canonical_bytes(np.array([5, 6], dtype=">i8")) == canonical_bytes([5, 6])  # (big-endian: refused)
    assert canonical_bytes(torch.tensor([5])) != canonical_bytes(5)  # (a list of one id is not that id)
    assert canonical_bytes(np.True_) == canonical_bytes(torch.tensor(True)) != canonical_bytes(1)
    for bad in (np.float32(1.0), torch.tensor([1.5]), np.datetime64(5, "ns"), np.timedelta64(5, "ns"),
                torch.empty(2, dtype=torch.int64, device="meta"), torch.tensor([1, 2]).to_sparse()):
        with pytest.raises(TypeError, match="canonically"):
            canonical_bytes(bad)


def test_namespace_is_readable_and_fingerprints_every_field() -> None:
    base: dict[str, Any] = dict(
        model="meta-llama/Meta-Llama-3-8B", dtype="torch.bfloat16", kv_layout="NHD", tp_rank=0, block_size=48
    )
    ns = namespace_for(**base)
    assert re.fullmatch(r"meta-llama-3-8b/bf16/tp0/b48-[0-9a-f]{8}", ns), ns
    assert namespace_for(**base) == ns
    variants: list[dict[str, Any]] = [
        {"model": "other/Meta-Llama-3-8B"},
        {"dtype": "float16"},
        {"kv_layout": "HND"},
        {"tp_rank": 1},
        {"block_size": 32},
    ]
    seen = {ns}
    for change in variants:
        seen.add(namespace_for(**{**base, **change}))
    seen.add(namespace_for(**base, tp_size=2))
    seen.add(namespace_for(**base, algo="xxh3_128"))
    seen.add(namespace_for(**base, revision="abc"))
    # Engines with GPU blocks of 16 and 48 tokens lay a 48-token payload out differently: sharing a
    # namespace, each failed to load the other's blocks and deleted them.
    seen.add(namespace_for(**base, gpu_block_size=16))
    seen.add(namespace_for(**base, gpu_block_size=48))
    assert len(seen) == len(variants) + 6
    # (before it was a parameter, a caller could pass it as an extra field: the same namespace)
    assert namespace_for(**base, gpu_block_size=16) == namespace_for(**base, **{"gpu_block_size": 16})
    assert namespace_for(**base, revision="abc", gpu_block_size=16) == namespace_for(**base, gpu_block_size=16,
                                                                                    revision="abc")
    assert all(len(s) <= 80 for s in seen)


def test_a_dtype_and_its_alias_share_a_namespace() -> None:
    # torch.half is torch.float16: an engine naming it "half" must find the blocks of one passing the dtype
    torch = pytest.importorskip("torch")  # (scripts/test.sh installs it)
    args = ("org/Model", "NHD", 0, 16)
    aliases = {"half": torch.float16, "float": torch.float32, "double": torch.float64, "short": torch.int16,
               "int": torch.int32, "long": torch.int64, "cfloat": torch.complex64, "cdouble": torch.complex128}
    for alias, dtype in aliases.items():
        assert getattr(torch, alias) is dtype
        ns = namespace_for(args[0], dtype, *args[1:])
        assert namespace_for(args[0], alias, *args[1:]) == ns
        assert namespace_for(args[0], f"torch.{alias}", *args[1:]) == ns
    assert namespace_for(args[0], "half", *args[1:]).split("/")[1] == "fp16"
