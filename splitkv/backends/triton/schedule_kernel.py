"""Triton split scheduler: one program turns cache_seqlens into the split table, on the GPU.

It computes exactly heuristics.schedule (the specification, in PyTorch; tests check they agree):
per request b, num_splits[b] and chunk_lens[b] (keys per split, block_n-aligned, equal within the
request) from the actual lengths (capped at the rule's span_cap: the keys a sliding window
shows) and the host-side SplitRule. Reading the lengths here, not on the
host, is what keeps decode free of a device->host sync and capturable in a CUDA graph.

Layouts: LENS any int32 [B] with stride s_len (a strided view is read as is); SCHED int32
[2, s_row]: row 0 num_splits, row 1 chunk_lens (s_row = B rounded up to 4: 16-byte aligned rows).
MODE 0 auto (balanced from the total work), 1 forced (SPLITS splits), 2 fixed chunk (batch-invariant).
WORK (auto plans whose grid is a work list, heuristics.work_items): also WORK int32 [2, s_work],
the (request, split) of each of the batch's splits in request order and -1 past the last
(heuristics.work_list), for the first `items` columns.
"""

import triton
import triton.language as tl


@triton.jit
def _count(t, ok, chunk):
    return tl.sum(tl.where(ok, tl.maximum((t + chunk - 1) // chunk, 1), 0), 0)


@triton.jit
def _search(t, ok, lo, hi, target):
    """Smallest chunk (tiles) in [lo, hi] whose total split count is <= target."""
    while lo < hi:
        mid = (lo + hi) // 2
        fits = _count(t, ok, mid) <= target
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid + 1)
    return lo


# The int arguments are not specialised on (== 1, divisible by 16): one compiled kernel per rule
# shape serves every batch size and length bound, so a warmed-up process compiles nothing when its
# batch changes. The kernel is one program; specialising would gain nothing.
_INTS = ("B", "s_len", "s_row", "s_work", "items", "max_splits", "splits", "chunk_tiles", "target", "ragged_target",
         "min_tiles", "span_cap")


@triton.jit(do_not_specialize=_INTS)
def schedule_kernel(LENS, SCHED, WORK, B, s_len, s_row, s_work, items, max_splits, splits, chunk_tiles, target,
                    ragged_target, min_tiles, span_cap, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_B: tl.constexpr, SHORT_KEYS: tl.constexpr, CAP: tl.constexpr, BALANCE: tl.constexpr,
                    HAS_WORK: tl.constexpr, BLOCK_W: tl.constexpr):
    offs = tl.arange(0, BLOCK_B)
    ok = offs < B
    L = tl.maximum(tl.load(LENS + offs.to(tl.int64) * s_len, mask=ok, other=0), 0)
    L = tl.minimum(L, span_cap)  # a sliding window: only the keys the queries can see are split
    t = (L + BLOCK_N - 1) // BLOCK_N
    if MODE == 1:
        n = tl.zeros_like(t) + splits
        chunk = tl.maximum((t + n - 1) // n, 1)
    else:
        if MODE == 2:
            n = tl.minimum(tl.maximum((t + chunk_tiles - 1) // chunk_tiles, 1), max_splits)
        else:
            longest = tl.max(tl.where(ok, t, 0), 0)
            n = tl.zeros_like(t) + 1
            if (max_splits > 1) & (longest * BLOCK_N >= SHORT_KEYS):
                lo = tl.maximum(min_tiles, (longest + CAP - 1) // CAP)
                hi = tl.maximum(lo, longest)
                c = _search(t, ok, lo, hi, target)
                n = tl.maximum((t + c - 1) // c, 1)
                worst = tl.max(tl.where(ok, (t + n - 1) // n, 0), 0)
                total_n = tl.sum(tl.where(ok, n, 0), 0)
                total_t = tl.sum(tl.where(ok, t, 0), 0)
                if (ragged_target > target) & (worst * total_n > BALANCE * total_t):
                    c = _search(t, ok, lo, hi, ragged_target)
                    n = tl.maximum((t + c - 1) // c, 1)
                n = tl.minimum(n, max_splits)
        chunk = tl.maximum((t + n - 1) // n, 1)
        n = tl.maximum((t + chunk - 1) // chunk, 1)
    tl.store(SCHED + offs, n, mask=ok)
    tl.store(SCHED + s_row + offs, chunk * BLOCK_N, mask=ok)
    if HAS_WORK:
        n = tl.where(ok, n, 0)
        ends = tl.cumsum(n, 0)  # request b's items are [ends[b] - n[b], ends[b])
        starts = ends - n
        total = tl.sum(n, 0)
        i0 = 0
        while i0 < items:  # a while loop: the interpreter's `range` rejects a runtime bound
            i = i0 + tl.arange(0, BLOCK_W)
            req = tl.sum((ends[None, :] <= i[:, None]).to(tl.int32), 1)  # requests wholly before item i
            split = i - tl.sum(tl.where(offs[None, :] == req[:, None], starts[None, :], 0), 1)
            live = i < total
            tl.store(WORK + i, tl.where(live, req, -1), mask=i < items)
            tl.store(WORK + s_work + i, tl.where(live, split, -1), mask=i < items)
            i0 += BLOCK_W
