"""Eviction policies: LRU and ARC orders, chain order, stranding, protected keys."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import pytest

from kvstore.eviction import POLICIES, ARCPolicy, EvictionPolicy, LRUPolicy, make_policy


def NONE(key: str) -> bool:  # noqa: N802 - reads as a constant: nothing is protected
    return False


def drain(policy: EvictionPolicy[str], protected: Callable[[str], bool] = NONE) -> list[str]:
    """Evict until None: the full eviction order."""
    out: list[str] = []
    while (key := policy.evict(protected)) is not None:
        out.append(key)
    return out


def put_chain(policy: EvictionPolicy[str], keys: Iterable[str]) -> None:
    """Add keys as a put batch does: head first, each with its predecessor as parent."""
    parent = None
    for key in keys:
        policy.add(key, parent)
        parent = key


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy[str]:
    return make_policy(request.param)


# -- registry -------------------------------------------------------------------


def test_registry_builds_policies_by_name() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("arc"), ARCPolicy)
    assert {name: cls.name for name, cls in POLICIES.items()} == {"lru": "lru", "arc": "arc"}
    assert make_policy("lru") is not make_policy("lru")


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"lru.*arc"):
        make_policy("fifo")


# -- contract shared by every policy ---------------------------------------------


def test_single_adds_leave_oldest_first(policy: EvictionPolicy[str]) -> None:
    for key in "abcd":
        policy.add(key)
    assert len(policy) == 4 and "c" in policy and "z" not in policy
    assert drain(policy) == ["a", "b", "c", "d"]
    assert len(policy) == 0 and policy.evict(NONE) is None


def test_put_batch_loses_its_tail_first(policy: EvictionPolicy[str]) -> None:
    # put [a0 a1 a2], then [b0 b1 b2] -> evicts a2, a1, a0, then b2, b1, b0
    put_chain(policy, ["a0", "a1", "a2"])
    put_chain(policy, ["b0", "b1", "b2"])
    assert drain(policy) == ["a2", "a1", "a0", "b2", "b1", "b0"]


def test_touched_chain_is_newest_and_loses_its_tail_first(policy: EvictionPolicy[str]) -> None:
    for key in ["x", "k0", "k1", "k2", "y"]:
        policy.add(key)
    # lookup [k0 k1 k2] -> order x, y, then k2, k1, k0
    policy.touch(["k0", "k1", "k2"])
    assert drain(policy) == ["x", "y", "k2", "k1", "k0"]


def test_touch_ignores_unknown_keys(policy: EvictionPolicy[str]) -> None:
    policy.add("a")
    policy.add("b")
    policy.touch(["zz", "a", "yy"])
    assert len(policy) == 2 and "zz" not in policy
    assert drain(policy) == ["b", "a"]


def test_child_goes_just_before_its_parent(policy: EvictionPolicy[str]) -> None:
    for key in ["p", "x", "y"]:
        policy.add(key)
    # c continues p's chain: never worth more than p -> order p's neighbourhood: c, p
    policy.add("c", parent="p")
    assert drain(policy) == ["c", "p", "x", "y"]


def test_read_with_parent_hint_keeps_chain_order(policy: EvictionPolicy[str]) -> None:
    put_chain(policy, ["k0", "k1", "k2"])
    policy.add("other")
    # get [k0 k1 k2], one key at a time, each after its parent -> k2, k1, k0 newest
    policy.touch(["k0"])
    policy.touch(["k1"], parent="k0")
    policy.touch(["k2"], parent="k1")
    assert drain(policy) == ["other", "k2", "k1", "k0"]


def test_protected_keys_are_set_aside_until_released(policy: EvictionPolicy[str]) -> None:
    for key in "abcd":
        policy.add(key)
    pinned = {"a", "c"}
    assert policy.evict(lambda k: k in pinned) == "b"
    assert policy.evict(lambda k: k in pinned) == "d"
    assert policy.evict(lambda k: k in pinned) is None
    assert len(policy) == 2 and "a" in policy and "c" in policy  # resident, set aside
    assert drain(policy) == []  # never offered while set aside ...
    policy.released("c")
    policy.released("a")
    policy.released("b")  # (not set aside: nothing happens)
    assert drain(policy) == ["c", "a"]  # ... and back as just used, in the order released


def test_a_released_key_goes_no_further_back_than_just_before_its_parent(policy: EvictionPolicy[str]) -> None:
    """Back at the end, a chain's block would outlive its parent (whose eviction strands it)."""
    put_chain(policy, ["a", "b", "c"])  # order c, b, a
    policy.add("x")
    assert policy.evict(lambda k: k in "bc") == "a"  # (c, b set aside)
    put_chain(policy, ["a2", "b2"])
    assert policy.evict(lambda k: k in "bc") == "x"
    policy.released("c", "b2")  # a parent in the same list: just before it
    policy.released("b")  # none: at the back
    assert drain(policy) == ["c", "b2", "a2", "b"]


def test_evict_stranded_only(policy: EvictionPolicy[str]) -> None:
    put_chain(policy, ["a", "b"])
    policy.add("c")
    assert policy.evict(NONE, stranded_only=True) is None
    policy.demote("b")
    assert policy.evict(NONE, stranded_only=True) == "b"
    assert policy.evict(NONE, stranded_only=True) is None and len(policy) == 2


def test_a_released_key_goes_behind_keys_used_while_it_was_pinned(policy: EvictionPolicy[str]) -> None:
    for key in "abc":
        policy.add(key)
    assert policy.evict(lambda k: k == "a") == "b"
    policy.add("d")
    policy.released("a")
    assert drain(policy) == ["c", "d", "a"]


def test_a_set_aside_key_that_is_touched_or_removed_is_not_set_aside_any_more(policy: EvictionPolicy[str]) -> None:
    for key in "abc":
        policy.add(key)
    assert policy.evict(lambda k: k in "ab") == "c"  # a, b aside
    policy.touch(["a"])  # placed at once
    policy.remove("b")
    policy.released("b")  # (gone: nothing happens)
    assert len(policy) == 1 and "b" not in policy
    assert drain(policy) == ["a"]


def test_a_set_aside_key_stranded_meanwhile_is_released_to_the_stranded_queue(policy: EvictionPolicy[str]) -> None:
    for key in "abc":
        policy.add(key)
    assert policy.evict(lambda k: k == "a") == "b"
    policy.demote("a")
    policy.released("a")
    policy.add("d")
    assert drain(policy) == ["a", "c", "d"]  # stranded first


def test_evict_none_keeps_every_key(policy: EvictionPolicy[str]) -> None:
    put_chain(policy, ["a", "b"])
    policy.add("c")
    policy.demote("b")
    assert policy.evict(lambda k: True) is None
    assert len(policy) == 3
    for key in "abc":
        policy.released(key)
    assert drain(policy) == ["b", "a", "c"]


def test_remove_forgets_the_key(policy: EvictionPolicy[str]) -> None:
    for key in "abc":
        policy.add(key)
    policy.remove("b")
    policy.remove("never-added")  # ignored
    assert "b" not in policy and len(policy) == 2
    assert drain(policy) == ["a", "c"]


def test_stranded_keys_leave_before_reachable_ones(policy: EvictionPolicy[str]) -> None:
    # put [a0 a1 a2 a3], then [b0 b1]; a1 is deleted -> a2, a3 stranded
    put_chain(policy, ["a0", "a1", "a2", "a3"])
    put_chain(policy, ["b0", "b1"])
    policy.remove("a1")
    policy.demote("a3")
    policy.demote("a2")
    policy.demote("nobody")  # ignored
    assert len(policy) == 5
    # stranded first (in demotion order), even though a0 is older
    assert drain(policy) == ["a3", "a2", "a0", "b1", "b0"]


def test_touching_a_stranded_key_makes_it_live_again(policy: EvictionPolicy[str]) -> None:
    for key in "abc":
        policy.add(key)
    policy.demote("c")
    policy.touch(["c"])  # a lookup reached it again
    assert drain(policy) == ["a", "b", "c"]


def test_protected_stranded_key_is_skipped(policy: EvictionPolicy[str]) -> None:
    for key in "abc":
        policy.add(key)
    policy.demote("b")
    policy.demote("c")
    assert policy.evict(lambda k: k == "b") == "c"
    assert policy.evict(lambda k: k == "b") == "a"
    policy.released("b")
    assert drain(policy) == ["b"]


def test_re_adding_a_resident_key_is_a_touch(policy: EvictionPolicy[str]) -> None:
    for key in "abc":
        policy.add(key)
    policy.add("a")
    assert len(policy) == 3
    assert drain(policy)[-1] == "a"


@pytest.mark.parametrize("where", ["live", "stranded", "t1"])
def test_skipping_pinned_keys_is_not_quadratic(policy: EvictionPolicy[str], where: str) -> None:
    """1000 pinned keys ahead of the victims (a long chain leased for a load), then 2000 evictions.

    ``t1``: under ARC the pinned keys are the whole of T1 (seen once) and T1 is tried first."""
    for i in range(1000):
        policy.add(f"pinned{i}")
    for i in range(2000):
        policy.add(f"k{i}")
        if where == "t1":
            policy.touch([f"k{i}"])  # seen twice: T2 under ARC
    if where == "stranded":
        for i in range(1000):
            policy.demote(f"pinned{i}")
    calls = 0

    def protected(key: str) -> bool:
        nonlocal calls
        calls += 1
        return key.startswith("pinned")

    assert len(drain(policy, protected)) == 2000
    assert calls <= 2000 + 1000 + 1  # each pinned key passed over once, not once per eviction
    assert len(policy) == 1000


# -- LRU ------------------------------------------------------------------------


def test_lru_touch_makes_keys_most_recent() -> None:
    lru = LRUPolicy[str]()
    for key in "abcd":
        lru.add(key)
    lru.touch(["b"])
    lru.touch(["a"])
    assert drain(lru) == ["c", "d", "b", "a"]


def test_lru_rereading_a_chain_in_place_keeps_the_order_a_partly_moved_one_is_placed() -> None:
    lru = LRUPolicy[str]()
    put_chain(lru, "abc")
    lru.add("x")
    lru.touch(list("abc"))  # a, b, c now newest: x, c, b, a
    lru.touch(list("abc"))  # read again: already in place, the fast path changes nothing
    lru.touch(list("ab"))  # a prefix of it: a and b stay just where they were
    assert drain(lru) == ["x", "c", "b", "a"]
    put_chain(lru, "abc")
    lru.add("y")
    lru.touch(list("ba"))  # not in place: moved to the back, b newest
    assert drain(lru) == ["c", "y", "a", "b"]


def test_a_run_standing_elsewhere_is_spliced_to_the_back_whole() -> None:
    lru = LRUPolicy[str]()
    put_chain(lru, "abc")  # stored as a run: c, b, a
    lru.add("x")
    lru.add("y")
    lru.touch(list("abc"))  # not in place (x, y are newer) but still one run: spliced
    assert list(lru._live) == ["x", "y", "c", "b", "a"]
    lru.touch(list("abc"), parent="b")  # one run, but the anchor is in it: moved key by key
    assert list(lru._live) == ["x", "y", "c", "b", "a"]
    lru.touch(list("xy"), parent="a")  # not one run: x just before a, y just before x
    assert list(lru._live) == ["c", "b", "y", "x", "a"]
    lru.touch(list("xy"), parent="c")  # one run now: spliced in front of c
    assert list(lru._live) == ["y", "x", "c", "b", "a"]
    assert drain(lru) == ["y", "x", "c", "b", "a"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_splicing_a_run_orders_keys_as_moving_them_one_by_one(
    name: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random adds, touches (runs, pieces of runs, shuffles), demotions and removals on two
    policies, one without the splice: the same evictions, in the same order, every time."""
    from kvstore import eviction

    rng = random.Random(seed)
    fast, slow = make_policy(name), make_policy(name)
    original = eviction._Order.place_run

    def move(order: eviction._Order[str], keys: list[str], anchor: object) -> bool:
        return False if order in slow_orders else original(order, keys, anchor)

    slow_orders = [v for v in vars(slow).values() if isinstance(v, eviction._Order)]
    monkeypatch.setattr(eviction._Order, "place_run", move)
    keys = [f"k{i}" for i in range(24)]
    for step in range(400):
        op, key = rng.random(), rng.choice(keys)
        if op < 0.3:
            parent = rng.choice([None, *keys])
            for p in (fast, slow):
                p.add(key, parent)
        elif op < 0.7:
            start = rng.randrange(len(keys))
            batch = keys[start : start + rng.randint(1, 8)]
            if rng.random() < 0.2:
                rng.shuffle(batch)
            parent = rng.choice([None, None, *keys])
            for p in (fast, slow):
                p.touch(list(batch), parent)
        elif op < 0.8:
            for p in (fast, slow):
                p.demote(key)
        elif op < 0.9:
            for p in (fast, slow):
                p.remove(key)
        else:
            protected = set(rng.sample(keys, 4))
            assert fast.evict(protected.__contains__) == slow.evict(protected.__contains__), step
            for key in sorted(protected):  # unpinned again
                for p in (fast, slow):
                    p.released(key)
        assert len(fast) == len(slow)
    assert drain(fast) == drain(slow)


# -- ARC ------------------------------------------------------------------------


def test_arc_evicts_once_seen_keys_before_frequent_ones() -> None:
    arc = ARCPolicy[str]()
    for key in "abcd":
        arc.add(key)
    arc.touch(["a"])  # a: T2 (seen twice), b c d: T1
    # p = 0 -> T1 goes first: b, c, d, then a
    assert drain(arc) == ["b", "c", "d", "a"]


def test_arc_resists_a_scan() -> None:
    arc = ARCPolicy[str]()
    hot = [f"hot{i}" for i in range(4)]
    for key in hot:
        arc.add(key)
        arc.touch([key])
    # a long scan of one-time keys, cache of 8 blocks: evict 1 per new key
    for i in range(50):
        if len(arc) >= 8:
            victim = arc.evict(NONE)
            assert victim is not None and victim.startswith("scan"), victim
        arc.add(f"scan{i}")
    assert all(key in arc for key in hot)


def test_arc_ghost_hit_in_b1_grows_t1_target() -> None:
    arc = ARCPolicy[str]()
    for key in "abcd":
        arc.add(key)
    arc.touch(["c", "d"])  # T1 = [a b], T2 = [d c]
    assert arc.evict(NONE) == "a"  # |T1| = 2 > p = 0: from T1, a goes to ghost B1
    assert arc.ghosts() == (1, 0) and "a" not in arc
    arc.add("a")  # ghost hit: recency was undervalued -> p grows, a lands in T2
    assert arc.p == 1.0 and arc.ghosts() == (0, 0)
    # T1 = [b] (1 <= p) -> T2 first: d, c (one access, tail first), a (newest); then b
    assert drain(arc) == ["d", "c", "a", "b"]


def test_arc_ghost_hit_in_b2_shrinks_t1_target() -> None:
    arc = ARCPolicy[str]()
    for key in "abc":
        arc.add(key)
    arc.touch(["a"])
    arc.p = 2.0  # favour T1 = [b c]: |T1| = 2 is not > p -> evict from T2
    assert arc.evict(NONE) == "a"
    assert arc.ghosts() == (0, 1)
    arc.add("a")  # ghost hit in B2: frequency was undervalued -> p shrinks
    assert arc.p == 1.0
    assert arc.evict(NONE) == "b"  # |T1| = 2 > p = 1: T1 first now


def test_arc_removed_and_stranded_keys_leave_no_ghost() -> None:
    arc = ARCPolicy[str]()
    for key in "abc":
        arc.add(key)
    arc.remove("a")
    arc.demote("b")
    assert arc.evict(NONE) == "b"
    assert arc.ghosts() == (0, 0)
    arc.add("a")
    arc.add("b")
    assert arc.p == 0.0  # no ghost hit
    assert drain(arc) == ["c", "a", "b"]


def test_arc_remembers_a_cache_worth_of_evicted_frequent_keys() -> None:
    """B2 (ghosts of keys evicted from T2) holds up to the cache's size, as in the paper (resident
    and ghost keys together at most twice it): a frequent key evicted within the last c evictions
    is recognised when it comes back, which is how ARC learns to favour frequency."""
    arc = ARCPolicy[str]()
    c = 8
    evicted = []
    for i in range(5 * c):
        if len(arc) == c:
            evicted.append(arc.evict(NONE))
        arc.add(f"k{i}")
        arc.touch([f"k{i}"])  # every key read again: all of them live in T2
    b1, b2 = arc.ghosts()
    assert b1 == 0 and c <= b2 and len(arc) + b2 <= 2 * c + 1
    for n, key in enumerate(reversed(evicted[-c:]), 1):  # the last c evicted: each a ghost hit
        arc.add(key)
        assert arc.ghosts() == (0, b2 - n), key


def test_arc_ghost_lists_stay_bounded() -> None:
    arc = ARCPolicy[str]()
    for i in range(10):
        arc.add(f"k{i}")
    for i in range(10, 1000):  # a cache of 10 blocks under constant churn
        assert arc.evict(NONE) is not None
        arc.add(f"k{i}")
        if i % 3 == 0:
            arc.touch([f"k{i}"])
    b1, b2 = arc.ghosts()
    assert b1 + b2 <= 2 * 10 and len(arc) == 10
