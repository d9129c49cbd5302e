"""The page arena: contiguous runs, exact accounting, reuse, and churn without overlap."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.arena import Arena, Extent

PS = 4096  # small pages keep the tests' arenas tiny


def take(arena: Arena, nbytes: int) -> Extent:
    extent = arena.alloc(nbytes)
    assert extent is not None
    return extent


def fill(arena: Arena, extent: Extent, nbytes: int, byte: int) -> None:
    for view in arena.views(extent, nbytes):
        view[:] = bytes([byte]) * len(view)


def content(arena: Arena, extent: Extent, nbytes: int) -> bytes:
    return b"".join(arena.views(extent, nbytes))


def test_capacity_rounds_down_to_whole_pages() -> None:
    arena = Arena(10 * PS + 123, PS)
    assert (arena.num_pages, arena.capacity, arena.free_pages, arena.used_bytes) == (10, 10 * PS, 10, 0)
    assert len(arena.buffer) == arena.capacity
    tiny = Arena(100, PS)  # at least one page
    assert (tiny.num_pages, tiny.capacity) == (1, PS)


@pytest.mark.parametrize("prefault", [True, False])
def test_fresh_memory_is_zeroed_and_writable(prefault: bool) -> None:
    arena = Arena(4 * PS, PS, prefault=prefault)
    assert arena.buffer[:] == bytes(4 * PS)
    arena.buffer[-1] = 7
    assert arena.buffer[-1] == 7


@pytest.mark.parametrize(("capacity", "page_size"), [(0, PS), (PS, 0), (-1, PS), (PS, -5)])
def test_rejects_non_positive_sizes(capacity: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        Arena(capacity, page_size)


def test_fresh_arena_hands_out_consecutive_runs() -> None:
    arena = Arena(64 * PS, PS)
    extents = [arena.alloc(16 * PS - 5) for _ in range(4)]
    # alloc 4 x 16 pages -> [0..15] [16..31] [32..47] [48..63], one run each
    assert extents == [((0, 16),), ((16, 16),), ((32, 16),), ((48, 16),)]
    assert arena.free_pages == 0 and arena.used_bytes == arena.capacity
    assert arena.alloc(1) is None


def test_alloc_rounds_up_to_pages_and_accounts_exactly() -> None:
    arena = Arena(8 * PS, PS)
    a = arena.alloc(1)
    b = arena.alloc(PS)
    c = arena.alloc(PS + 1)
    assert a is not None and b is not None and c is not None
    assert [Arena.pages(x) for x in (a, b, c)] == [1, 1, 2]
    assert arena.free_pages == 4 and arena.used_bytes == 4 * PS and arena.free_bytes == 4 * PS
    arena.free(c)
    assert arena.free_pages == 6 and arena.used_bytes == 2 * PS


def test_zero_bytes_take_no_pages() -> None:
    arena = Arena(2 * PS, PS)
    extent = arena.alloc(0)
    assert extent == () and arena.free_pages == 2
    assert arena.views(extent, 0) == []
    arena.free(extent)
    assert arena.free_pages == 2


def test_alloc_too_much_returns_none_and_changes_nothing() -> None:
    arena = Arena(4 * PS, PS)
    assert arena.alloc(3 * PS) is not None
    before = (arena.free_pages, repr(arena))
    assert arena.alloc(2 * PS) is None
    assert (arena.free_pages, repr(arena)) == before
    with pytest.raises(ValueError):
        arena.alloc(-1)


def test_freed_run_is_reused_whole() -> None:
    arena = Arena(48 * PS, PS)
    a, b, c = (arena.alloc(16 * PS) for _ in range(3))
    assert b == ((16, 16),)
    assert a is not None and b is not None and c is not None
    # free [16..31] -> alloc 16 pages again -> exactly [16..31], one run
    arena.free(b)
    assert arena.alloc(16 * PS) == ((16, 16),)


def test_best_fit_keeps_large_runs_whole() -> None:
    arena = Arena(40 * PS, PS)
    blocks = [take(arena, 4 * PS) for _ in range(10)]
    arena.free(blocks[1])  # hole of 4 at [4..7]
    arena.free(blocks[8])  # hole of 4 at [32..35]
    arena.free(blocks[9])  # merges into a hole of 8 at [32..39]
    # alloc 4 pages -> the 4-page hole, not a piece of the 8-page one
    assert arena.alloc(4 * PS) == ((4, 4),)
    assert arena.alloc(8 * PS) == ((32, 8),)


def test_free_coalesces_neighbours_into_one_run() -> None:
    arena = Arena(12 * PS, PS)
    a, b, c = (arena.alloc(4 * PS) for _ in range(3))
    assert a is not None and b is not None and c is not None
    arena.free(a)
    arena.free(c)
    arena.free(b)  # merges with both neighbours
    assert arena.alloc(12 * PS) == ((0, 12),)


def test_fragmented_free_space_still_fits_and_views_follow_runs() -> None:
    arena = Arena(8 * PS, PS)
    pages = [arena.alloc(PS) for _ in range(8)]
    for extent in pages[::2]:
        assert extent is not None
        arena.free(extent)  # free pages 0, 2, 4, 6
    extent = arena.alloc(3 * PS + 10)  # needs 4 pages, no two adjacent
    assert extent is not None and Arena.pages(extent) == 4 and len(extent) == 4
    views = arena.views(extent, 3 * PS + 10)
    assert [len(v) for v in views] == [PS, PS, PS, 10]
    payload = bytes(range(256)) * ((3 * PS + 10) // 256) + bytes(range((3 * PS + 10) % 256))
    offset = 0
    for view in views:
        view[:] = payload[offset : offset + len(view)]
        offset += len(view)
    assert content(arena, extent, len(payload)) == payload
    readonly = arena.views(extent, len(payload), readonly=True)
    assert [len(v) for v in readonly] == [PS, PS, PS, 10] and all(v.readonly for v in readonly)
    assert b"".join(readonly) == payload


def test_views_cover_exactly_nbytes() -> None:
    arena = Arena(8 * PS, PS)
    fill(arena, take(arena, PS), PS, 0xEE)  # a neighbour: views must not reach into it
    extent = take(arena, 3 * PS)
    fill(arena, extent, 3 * PS, 0x5A)
    for nbytes in (0, 1, PS, 2 * PS + 1, 3 * PS):
        for readonly in (False, True):
            views = arena.views(extent, nbytes, readonly=readonly)
            assert sum(len(v) for v in views) == nbytes
            assert all(v.readonly == readonly for v in views)
            assert b"".join(views) == b"\x5a" * nbytes
    assert len(arena.views(extent, 3 * PS)) == 1  # one run, one view
    for bad in (-1, 3 * PS + 1):
        for readonly in (False, True):
            with pytest.raises(ValueError):
                arena.views(extent, bad, readonly=readonly)


def test_double_free_raises_and_changes_nothing() -> None:
    arena = Arena(8 * PS, PS)
    a = arena.alloc(2 * PS)
    b = arena.alloc(2 * PS)
    assert a is not None and b is not None
    arena.free(a)
    before = (arena.free_pages, repr(arena))
    with pytest.raises(ValueError):
        arena.free(a)
    with pytest.raises(ValueError):
        arena.free(b + a)  # half valid: nothing may be freed
    with pytest.raises(ValueError):
        arena.free(((7, 5),))  # past the end
    (start, n), = b
    with pytest.raises(ValueError):
        arena.free(((start, n), (start + 1, 1)))  # allocated pages, but one of them twice
    assert (arena.free_pages, repr(arena)) == before


def test_one_mib_churn_reuses_the_freed_pages_in_one_run_and_never_fragments() -> None:
    """Free one block, take one of the same size, 2000 times in a half-full arena: each take gets
    the pages just freed (warm, one contiguous run), and the free space stays in as many runs as
    there are holes -- the churn itself leaves nothing behind. (How fast it is: kvstore-bench.)"""
    arena = Arena(256 << 20, 64 * 1024, prefault=False)
    live = [take(arena, 1 << 20) for _ in range(128)]
    runs_before = repr(arena)
    for i in range(2000):
        freed = live[i % 128]
        arena.free(freed)
        live[i % 128] = take(arena, 1 << 20)
        assert live[i % 128] == freed and len(freed) == 1
    assert repr(arena) == runs_before  # free pages and free runs exactly as before the churn
    assert arena.free_pages == arena.num_pages - 128 * 16


def check_disjoint(arena: Arena, live: dict[int, tuple[Extent, int]]) -> None:
    owner = [-1] * arena.num_pages
    for ident, (extent, _) in live.items():
        for start, n in extent:
            for page in range(start, start + n):
                assert owner[page] == -1, f"page {page} in blocks {owner[page]} and {ident}"
                owner[page] = ident
    used = sum(Arena.pages(extent) for extent, _ in live.values())
    assert arena.free_pages == arena.num_pages - used


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_churn_never_overlaps_and_keeps_data(seed: int) -> None:
    rng = random.Random(seed)
    page = 256
    arena = Arena(512 * page, page)
    live: dict[int, tuple[Extent, int]] = {}
    for ident in range(4000):
        if live and (rng.random() < 0.45 or arena.free_pages < 40):
            victim = rng.choice(list(live))
            old, old_nbytes = live.pop(victim)
            assert content(arena, old, old_nbytes) == bytes([victim % 251]) * old_nbytes
            arena.free(old)
        nbytes = rng.choice([0, 1, page - 1, page, rng.randrange(1, 40 * page)])
        extent = arena.alloc(nbytes)
        if extent is None:
            assert arena.pages_for(nbytes) > arena.free_pages
            continue
        assert sum(len(v) for v in arena.views(extent, nbytes)) == nbytes
        fill(arena, extent, nbytes, ident % 251)
        live[ident] = (extent, nbytes)
        if ident % 500 == 0:
            check_disjoint(arena, live)
    check_disjoint(arena, live)
    for ident, (extent, nbytes) in live.items():
        assert content(arena, extent, nbytes) == bytes([ident % 251]) * nbytes
    for extent, _ in live.values():
        arena.free(extent)
    assert arena.free_pages == arena.num_pages
    assert arena.alloc(arena.capacity) == ((0, arena.num_pages),)  # everything coalesced back


class ArenaMachine(RuleBasedStateMachine):
    """Hypothesis drives alloc/free; every block keeps its bytes and its own pages."""

    def __init__(self) -> None:
        super().__init__()
        self.arena = Arena(64 * 128, 128)
        self.live: dict[int, tuple[Extent, int]] = {}
        self.next_id = 0

    @rule(nbytes=st.integers(min_value=0, max_value=20 * 128))
    def alloc(self, nbytes: int) -> None:
        extent = self.arena.alloc(nbytes)
        if extent is None:
            assert self.arena.pages_for(nbytes) > self.arena.free_pages
            return
        self.next_id += 1
        fill(self.arena, extent, nbytes, self.next_id % 251)
        self.live[self.next_id] = (extent, nbytes)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ident = data.draw(st.sampled_from(sorted(self.live)))
        extent, nbytes = self.live.pop(ident)
        assert content(self.arena, extent, nbytes) == bytes([ident % 251]) * nbytes
        self.arena.free(extent)

    @invariant()
    def disjoint_and_accounted(self) -> None:
        check_disjoint(self.arena, self.live)


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
