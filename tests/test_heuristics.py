"""The split rule and the schedule it drives (pure functions, fake SM counts, no GPU)."""

import pytest
import torch

import splitkv
from splitkv import heuristics as H


def _rule(lens, hkv=8, num_sms=132, bps=2, bound=None, **kw):
    return H.split_rule(batch=len(lens), groups_per_request=hkv, block_n=64, max_seqlen=bound or max(lens),
                        num_sms=num_sms, blocks_per_sm=bps, **kw)


def _sched(lens, **kw):
    rule = _rule(lens, **kw)
    n, c = H.schedule(torch.tensor(lens, dtype=torch.int32), rule)
    return rule, n.tolist(), c.tolist()


def _ranges(L, n, c):
    """Key ranges of the splits of one request, as the kernels walk them."""
    return [(s * c, L if s == n - 1 else min((s + 1) * c, L)) for s in range(n)]


RAGGED = [int(1024 * 2 ** (7 * i / 15)) for i in range(16)]  # B=16, 1K .. 128K


@pytest.mark.parametrize("num_sms", [8, 78, 132])
@pytest.mark.parametrize("lens", [[131072], [32768] * 4, [4096], [1024, 131072, 65537, 5], [0, 17, 113, 4097],
                                  RAGGED])
@pytest.mark.parametrize("hkv", [1, 8, 32])
def test_schedule_covers_every_key_once_within_bounds(num_sms, lens, hkv):
    rule, n, c = _sched(lens, hkv=hkv, num_sms=num_sms)
    for L, nb, cb in zip(lens, n, c):
        assert 1 <= nb <= rule.max_splits <= H.MAX_SPLITS and cb % 64 == 0
        r = _ranges(L, nb, cb)
        covered = [k for a, b in r for k in range(a, b)] if L < 5000 else None
        assert covered is None or covered == list(range(L))  # every key exactly once, in order
        assert r[0][0] == 0 and r[-1][1] == L and all(r[i][1] == r[i + 1][0] for i in range(nb - 1))
        assert all(b - a <= cb for a, b in r)  # no CTA streams more than its chunk
        assert nb == 1 or all(b > a for a, b in r)  # no empty trailing split
        if nb > 1:
            assert cb >= H.MIN_CHUNK_KEYS


def _works(lens, n, c):
    return [b - a for L, nb, cb in zip(lens, n, c) for a, b in _ranges(L, nb, cb)]


@pytest.mark.parametrize("num_sms,bps", [(132, 2), (132, 1), (264, 2)])
def test_ragged_batch_is_balanced(num_sms, bps):
    rule, n, c = _sched(RAGGED, num_sms=num_sms, bps=bps)
    works = _works(RAGGED, n, c)
    assert max(works) <= H.BALANCE * sum(works) / len(works)  # the largest CTA vs the mean CTA


def test_full_grid_ragged_batch_splits_its_long_requests():
    """B x groups >= SMs: uniform batches stay unsplit, a ragged one cuts its longest requests as
    finely as the balance needs (a work list, not FULL_GRID_MAX_SPLITS columns), in 4 x B items."""
    rule, n, c = _sched(RAGGED, num_sms=66)
    assert rule.listed and n[-1] > H.FULL_GRID_MAX_SPLITS and n[0] == 1
    assert sum(n) <= H.work_items(rule, len(RAGGED)) == H.RAGGED_SPLITS_PER_REQUEST * len(RAGGED)
    works = _works(RAGGED, n, c)
    assert max(works) <= H.BALANCE * sum(works) / len(works)
    assert _sched([32768] * 16, num_sms=66)[1] == [1] * 16


def test_full_grid_short_bound_keeps_the_grid():
    """A full GPU whose bound allows no more than FULL_GRID_MAX_SPLITS splits: the grid, no list."""
    rule = H.split_rule(batch=64, groups_per_request=8, block_n=64, max_seqlen=1024, num_sms=132)
    assert not rule.listed and 1 < rule.max_splits <= H.FULL_GRID_MAX_SPLITS
    assert H.work_items(rule, 64) is None


def test_uniform_batch_fills_one_wave():
    rule, n, c = _sched([32768] * 4, hkv=8, num_sms=132, bps=2)
    assert sum(n) * 8 <= 132 * 2 and sum(n) * 8 > 132  # one wave of two CTAs per SM, not less
    rule, n, c = _sched([131072], hkv=8, num_sms=132, bps=1)
    assert n == [16]  # cutlass target: one CTA per SM


def test_no_split_when_grid_already_full():
    rule, n, c = _sched([32768] * 16, hkv=32)  # 512 CTAs
    assert rule.listed and n == [1] * 16


def test_no_split_for_short_sequences():
    assert _sched([300])[1] == [1]
    rule, n, c = _sched([300], bound=131072)  # a long bound, short actual lengths: decided on device
    assert rule.max_splits > 1 and n == [1]


def test_longer_sequences_get_more_splits_and_more_sms_more_splits():
    rule, s, c = _sched([1024, 16384, 131072])
    assert s[0] <= s[1] <= s[2] and s[2] > s[0]
    assert _sched([131072], num_sms=132)[1][0] > _sched([131072], num_sms=16)[1][0]


def test_schedule_depends_on_actual_lengths_not_the_bound():
    """A plan sized for a 128K capacity balances 4K requests as one made for 4K."""
    assert _sched([4096, 4000], bound=131072)[1:] == _sched([4096, 4000])[1:]


def test_forced_and_batch_invariant_rules():
    rule, n, c = _sched([1000, 0, 17], hkv=2, num_splits=3)
    assert n == [3, 3, 3] and rule.max_splits == 3 and all(x % 64 == 0 for x in c) and c[0] * 3 >= 1000
    assert _rule([100], num_splits=10 ** 7).max_splits == 2  # bounded by what a row can use (2 tiles)
    far = _rule([100], num_splits=10 ** 7, bound=10 ** 9)  # a graph-safe bound: no 10**7-row workspace
    assert far.max_splits == H.MAX_FORCED_SPLITS
    a = _sched([5000, 70000], batch_invariant=True, bound=131072)
    b = _sched([5000], batch_invariant=True, bound=131072)
    assert a[1][0] == b[1][0] == 3 and a[2][0] == b[2][0] <= H.BATCH_INVARIANT_CHUNK_KEYS  # its own length only


def test_tile_config_packs_gqa_rows():
    assert H.tile_config(128, 4).block_m == 16  # mma minimum
    assert H.tile_config(128, 7 * 3).block_m == 32
    t = H.tile_config(128, 16 * 16)
    assert t.block_m == H.MAX_BLOCK_M and H.query_tiles(256, t.block_m) == 4


def test_print_plan(capsys, monkeypatch):
    monkeypatch.setenv("SPLITKV_PRINT_PLAN", "1")
    splitkv.plan(torch.tensor([5000], dtype=torch.int32), 32, 8, 128, num_sms=132)
    out = capsys.readouterr().out
    assert "DecodePlan" in out and "max_splits=" in out


@pytest.mark.parametrize("backend", ["triton", "cutlass"])
def test_plans_that_stream_whole_sequences_take_the_unsplit_tile(backend):
    """A plan's grid may split, but when a uniform batch at its bound gets one chunk per request
    (triton) or chunks of >= LONG_CHUNK_KEYS (both; cutlass D 128: in a grid of which the uniform
    batch leaves CTAs empty) its CTAs stream whole sequences and the backend's unsplit tile
    (block_n 128) serves them; plans that split keep block_n 64, and a batch-invariant plan keeps
    one tile whatever the batch."""
    import splitkv
    from splitkv.backends import cutlass

    if backend == "cutlass" and not cutlass.available():
        pytest.skip("nvidia-cutlass-dsl not installed (cutlass plans need it)")

    def tile(B, L, hq, hkv, **kw):
        p = splitkv.plan(torch.full((B,), L, dtype=torch.int32), hq, hkv, 128, backend=backend, num_sms=132, **kw)
        return p.tile.block_n, p.max_splits

    assert tile(64, 32768, 32, 8) == (128, tile(64, 32768, 32, 8)[1])
    assert tile(1, 32768, 32, 8)[0] == 64  # 16-32 chunks of 1-2K keys
    assert tile(16, 4096, 32, 32, batch_invariant=True)[0] == 64
    assert tile(4, 32768, 32, 32)[0] == 128  # 2 chunks of 16K keys
    assert tile(16, 131072, 32, 8)[0] == 128  # 2 chunks of 64K keys
    assert tile(1, 131072, 32, 8)[0] == 64  # 16-33 chunks of 4-8K keys
    # 4 chunks of 32K keys per KV head: a grid that works in full at the bound, where CuTe's split
    # tile streams long chunks better (heuristics.DENSE_LONG_CHUNKS_SPLIT_TILE_DIMS); Triton's is 128
    assert tile(1, 131072, 32, 32)[0] == (64 if backend == "cutlass" else 128)
    assert tile(4, 131072, 32, 8)[0] == (64 if backend == "cutlass" else 128)  # a work list of 16 such items
    if backend == "triton":
        bn, splits = tile(16, 4096, 32, 32)
        assert bn == 128 and splits > 1  # a split grid of which a uniform batch uses one split per request
        assert tile(16, 4096, 32, 32, paged=True)[0] == 128


def test_cutlass_plans_streaming_whole_sequences_in_waves_take_the_three_stage_tile():
    """D 128 contiguous cutlass plans whose uniform batch at the bound runs one CTA per request and
    (KV head, m-tile) group, more than two per SM, take WAVES_TILE (n128 s3) whether the grid may split
    or not; one wave, paged caches, other head dims, batch-invariant plans and plans that split at
    the bound keep their tiles."""
    import splitkv
    from splitkv.backends import cutlass

    assert H.cutlass_tile(128, True, False, False, waves=True) == H.WAVES_TILE == (128, 3)
    assert H.cutlass_tile(128, False, True, False, waves=True) == (64, 3)  # paged
    assert H.cutlass_tile(96, True, False, False, waves=True) == (64, 3)  # D 80 / 96: their own tiles
    rule = H.split_rule(batch=34, groups_per_request=8, block_n=64, max_seqlen=512, num_sms=132)
    assert H.streams_in_waves(rule, 34, 512, 8, 132, False)  # 272 CTAs of one chunk each
    assert not H.streams_in_waves(rule, 34, 512, 8, 136, False)  # two per SM hold them
    assert not H.streams_in_waves(rule, 34, 512, 8, 132, True)  # batch-invariant
    if not cutlass.available():
        pytest.skip("nvidia-cutlass-dsl not installed (cutlass plans need it)")

    def tile(B, L, hq, hkv, d=128, **kw):
        p = splitkv.plan(torch.full((B,), L, dtype=torch.int32), hq, hkv, d, backend="cutlass", num_sms=132, **kw)
        return p.tile.block_n, p.tile.num_stages

    assert tile(64, 4096, 32, 32) == (128, 3)  # 2048 CTAs (split tile n64 s3 before)
    assert tile(16, 32768, 32, 32) == (128, 3)  # 512 CTAs of 32K keys (n128 s2 before)
    assert tile(34, 512, 32, 8) == (128, 3)
    assert tile(64, 4096, 32, 32, num_splits=1) == (128, 3)
    assert tile(32, 4096, 32, 8) == (64, 3)  # 256 CTAs: one wave of the split tile's two per SM
    assert tile(4, 32768, 32, 32) == (128, 2)  # one wave of 16K-key chunks
    assert tile(1, 4096, 32, 32, num_splits=1) == (128, 2)
    assert tile(64, 4096, 32, 32, num_splits=2) == (64, 3)  # two chunks per request
    assert tile(64, 4096, 32, 32, paged=True) == (64, 3)
    assert tile(64, 4096, 32, 32, batch_invariant=True) == (64, 3)
    assert tile(64, 4096, 32, 32, d=96) == (64, 3)


def test_unsplit_tile_plans_decode_ragged_batches_exactly():
    """A Triton plan that took the 128-key tile because a uniform batch at its bound streams whole
    sequences still splits a ragged batch on the device (chunks sized in the rule's tiles): every
    split and its merge stay exact (interpreted Triton on the CPU, the fp64 reference)."""
    from helpers import assert_close_to_reference, make_inputs, to_paged

    import splitkv

    lens = [1487, 100, 7]
    q, k, v, sl = make_inputs(3, 1, 4, 2, 64, lens, torch.float16, seed=5)
    p = splitkv.plan(sl, 4, 2, 64, backend="triton", num_sms=4, max_seqlen=1500)
    assert p.tile.block_n == 128 and p.max_splits > 1
    p.refresh(sl)
    assert int(p.num_splits[0]) > 1  # the long request splits
    o, lse = splitkv.decode(q, k, v, sl, plan=p, backend="triton", return_lse=True)
    assert_close_to_reference(o, lse, q, k, v, sl)
    kp, vp, bt = to_paged(k, v, lens, 16)
    pp = splitkv.plan(sl, 4, 2, 64, backend="triton", num_sms=4, max_seqlen=1500, paged=True)
    assert pp.tile.block_n == 128
    o, lse = splitkv.decode(q, kp, vp, sl, block_table=bt, plan=pp, backend="triton", return_lse=True)
    assert_close_to_reference(o, lse, q, k, v, sl)


def test_aligned_page_lookup_only_where_every_tile_starts_on_a_page_boundary():
    """The Triton split kernel's aligned page lookup (PAGE_ALIGNED) assumes every key tile starts at
    a multiple of min(page_size, block_n): not with a sliding window, not for a page size that is no
    power of 2 or whose pages the rule's chunks do not start on; fp8 plans take it too."""
    from splitkv.backends.triton.launch import _page_aligned

    lens = torch.tensor([4096], dtype=torch.int32)
    p = splitkv.plan(lens, 8, 2, 64, backend="triton", paged=True, num_splits=3)
    assert p.aligned_pages and p.rule.block_n == 64
    assert _page_aligned(16, 64, p) and _page_aligned(64, 64, p) and _page_aligned(128, 64, p)
    assert not _page_aligned(24, 64, p)  # not a power of 2
    assert not _page_aligned(256, 128, p)  # a 128-key tile starting at a multiple of 64 may cross a page
    assert not splitkv.plan(lens, 8, 2, 64, backend="triton", paged=False).aligned_pages
    assert not splitkv.plan(lens, 8, 2, 64, backend="triton", paged=True, window_size=(100, 0)).aligned_pages
    assert not splitkv.plan(lens, 8, 2, 64, backend="torch", paged=True).aligned_pages
    fp8 = dict(backend="triton", paged=True, kv_dtype=torch.float8_e4m3fn, k_scale=1.0, v_scale=1.0, num_sms=132)
    b16 = splitkv.plan(torch.full((16,), 32768, dtype=torch.int32), 32, 8, 128, **fp8)
    b1 = splitkv.plan(torch.tensor([131072], dtype=torch.int32), 32, 8, 128, **fp8)
    assert b16.aligned_pages and b1.aligned_pages
