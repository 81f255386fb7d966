"""PagedKVCache: a property test against a dict-of-lists model, RoPE on append, and decode over the
cache's block tables against the reference (the append kernel itself: test_append_kernel.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_to_reference
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_rope import rope_reference

import splitkv
from splitkv.cache import CacheFullError, PagedKVCache
from splitkv.reference import gather_keys
from splitkv.rope import RopeConfig, apply_rope

HKV, D = 2, 4  # tiny heads: the model check is about page bookkeeping, not arithmetic


def need_pages(cache, ids, counts, layer):
    """Free pages an append needs, from the set view: fresh pages past each sequence's last page,
    plus one copy per writer of a shared page, except that the last holder of a page held only by
    writers of this append may keep it (a written page must end up with refcount 1)."""
    ps = cache.page_size
    fresh, writers = 0, {}
    for sid, n in zip(ids, counts, strict=True):
        start, pages = cache.seq_len(sid, layer), cache.pages(sid)
        fresh += max(0, math.ceil((start + n) / ps) - len(pages))
        for j in range(start // ps, min(math.ceil((start + n) / ps), len(pages))) if n else ():
            writers[pages[j]] = writers.get(pages[j], 0) + 1
    copies = sum(w if cache.refcount(p) > w else w - 1 for p, w in writers.items())
    return fresh + copies


class CacheMachine(RuleBasedStateMachine):
    """Random add / append / fork / free against `model[sid][layer]` = list of (k_row, v_row)."""

    @initialize(num_pages=st.integers(1, 10), page_size=st.sampled_from([1, 2, 3, 4]),
                num_layers=st.integers(1, 2))
    def setup(self, num_pages, page_size, num_layers):
        self.cache = PagedKVCache(num_pages, page_size, HKV, D, num_layers=num_layers, dtype=torch.float32,
                                  device="cpu", backend="torch")
        for layer in range(num_layers):  # unwritten slots are NaN: a stray read shows
            self.cache.k_pages(layer).fill_(float("nan"))
            self.cache.v_pages(layer).fill_(float("nan"))
        self.model: dict[int, list[list]] = {}
        self.family: dict[int, int] = {}  # sid -> the sequence it was forked from, transitively
        self.counter = 0

    def snapshot(self):
        c = self.cache
        return (c.num_free_pages, [c.refcount(p) for p in range(c.num_pages)],
                {s: (c.pages(s), [c.seq_len(s, la) for la in range(c.num_layers)]) for s in c.seq_ids()},
                c._k.clone(), c._v.clone())

    @rule()
    def add(self):
        sid = self.cache.add_sequence()
        assert sid not in self.model
        self.model[sid] = [[] for _ in range(self.cache.num_layers)]
        self.family[sid] = sid

    def _draw_batch(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        T = data.draw(st.integers(0, 5))
        lengths = data.draw(st.none() | st.lists(st.integers(0, T), min_size=len(ids), max_size=len(ids)))
        return ids, T, lengths

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append(self, data):
        ids, T, lengths = self._draw_batch(data)
        self._append(ids, T, data.draw(st.integers(0, self.cache.num_layers - 1)), lengths)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def model_step(self, data):
        """Every layer appends the same tokens, in order (append reuses layer 0's write plan),
        with perhaps a fork of one of them between two layers."""
        ids, T, lengths = self._draw_batch(data)
        fork_after = data.draw(st.none() | st.integers(0, self.cache.num_layers - 1))
        for layer in range(self.cache.num_layers):
            if not self._append(ids, T, layer, lengths):
                return
            if layer == fork_after:
                self._fork(data.draw(st.sampled_from(ids)))

    def _append(self, ids, T, layer, lengths) -> bool:
        counts = lengths if lengths is not None else [T] * len(ids)
        n = len(ids) * T * HKV * D
        k = torch.arange(self.counter, self.counter + n, dtype=torch.float32).view(len(ids), T, HKV, D)
        v = -k - 0.5
        self.counter += n
        need, free = need_pages(self.cache, ids, counts, layer), self.cache.num_free_pages
        before = self.snapshot()
        starts = [self.cache.seq_len(s, layer) for s in ids]
        try:
            self.cache.append(ids, k, v, layer, lengths=lengths)
        except CacheFullError as e:
            assert need > free and e.needed == need and e.free == free
            after = self.snapshot()
            assert before[:3] == after[:3]
            for pool_before, pool_after in zip(before[3:], after[3:], strict=True):
                torch.testing.assert_close(pool_after, pool_before, equal_nan=True, atol=0, rtol=0)
            return False
        assert need <= free, "appended although the pool was short"
        assert self.cache.num_free_pages == free - need, "used more pages than needed"
        ps = self.cache.page_size
        for i, (sid, c) in enumerate(zip(ids, counts, strict=True)):
            self.model[sid][layer] += [(k[i, t], v[i, t]) for t in range(c)]
            pages = self.cache.pages(sid)
            for j in range(starts[i] // ps, math.ceil((starts[i] + c) / ps)) if c else ():
                assert self.cache.refcount(pages[j]) == 1, "a page written by append is still shared"
        return True

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data.draw(st.sampled_from(sorted(self.model))))

    def _fork(self, sid):
        free = self.cache.num_free_pages
        nid = self.cache.fork(sid)
        assert self.cache.num_free_pages == free, "fork must not allocate (lazy copy-on-write)"
        self.model[nid] = [list(rows) for rows in self.model[sid]]
        self.family[nid] = self.family[sid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(sid)
        del self.model[sid]
        assert sid not in self.cache

    @invariant()
    def pages_are_owned_once(self):
        if not hasattr(self, "cache"):
            return
        c, ps = self.cache, self.cache.page_size
        holders: dict[int, list] = {}
        for sid in self.model:
            pages = c.pages(sid)
            assert len(set(pages)) == len(pages), "a page appears twice in one sequence"
            longest = max(c.seq_len(sid, la) for la in range(c.num_layers))
            assert len(pages) == math.ceil(longest / ps)
            for j, p in enumerate(pages):
                holders.setdefault(p, []).append((sid, j))
        for p in range(c.num_pages):
            assert c.refcount(p) == len(holders.get(p, [])), f"page {p}: refcount != holders"
            if len(holders.get(p, [])) > 1:  # shared only through fork, at the same position
                assert len({self.family[s] for s, _ in holders[p]}) == 1
                assert len({j for _, j in holders[p]}) == 1
        assert c.num_free_pages == c.num_pages - len(holders), "leaked page"

    @invariant()
    def contents_match_model(self):
        if not hasattr(self, "cache"):
            return
        ids = sorted(self.model)
        for layer in range(self.cache.num_layers):
            bt, sl = self.cache.batch(ids, layer)
            assert sl.tolist() == [len(self.model[s][layer]) for s in ids]
            for b, sid in enumerate(ids):
                rows = self.model[sid][layer]
                if rows:
                    kk = gather_keys(self.cache.k_pages(layer), b, len(rows), bt)
                    vv = gather_keys(self.cache.v_pages(layer), b, len(rows), bt)
                    assert torch.equal(kk, torch.stack([r[0] for r in rows]))
                    assert torch.equal(vv, torch.stack([r[1] for r in rows]))


CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_cache_against_model = CacheMachine.TestCase


def test_fork_shares_full_pages_and_copies_the_partial_one_on_write():
    c = PagedKVCache(8, 4, HKV, D, num_layers=2, dtype=torch.float32, device="cpu")
    a = c.add_sequence()
    x = torch.randn(1, 6, HKV, D)
    for layer in range(2):
        c.append([a], x, x + 1, layer)
    b = c.fork(a)
    assert c.pages(b) == c.pages(a) == [0, 1] and c.refcount(1) == 2
    c.append([b], x[:, :1], x[:, :1], 0)  # b writes into the shared partial page 1: b copies it
    assert c.pages(b)[0] == 0 and c.pages(b)[1] not in (0, 1) and c.refcount(1) == 1
    assert torch.equal(c.k_pages(1)[c.pages(b)[1], :2], x[0, 4:6]), "the copy must carry every layer"
    c.append([a], x[:, :1], x[:, :1], 0)  # a is page 1's last holder: it writes in place
    assert c.pages(a) == [0, 1] and c.num_free_pages == 5
    c.free(a)
    assert c.refcount(0) == 1 and c.refcount(1) == 0 and c.num_free_pages == 6
    c.free(b)
    assert c.num_free_pages == 8


def test_cache_full_leaves_state_and_fork_never_raises():
    c = PagedKVCache(3, 2, HKV, D, dtype=torch.float32, device="cpu")
    a, b = c.add_sequence(), c.add_sequence()
    c.append([a], torch.ones(1, 5, HKV, D), torch.ones(1, 5, HKV, D))  # 3 pages, pool now empty
    f = c.fork(a)  # no page needed
    with pytest.raises(CacheFullError) as e:
        c.append([b, f], torch.zeros(2, 1, HKV, D), torch.zeros(2, 1, HKV, D))
    assert (e.value.needed, e.value.free) == (2, 0)
    assert c.seq_len(b) == 0 and c.seq_len(f) == 5 and c.pages(f) == c.pages(a) and c.num_free_pages == 0
    c.free(a)  # f is now the only holder of a's pages: it appends in place
    c.append([f], torch.zeros(1, 1, HKV, D), torch.zeros(1, 1, HKV, D))
    assert c.seq_len(f) == 6 and c.num_free_pages == 0


def test_layers_share_pages_and_advance_separately():
    c = PagedKVCache(8, 4, HKV, D, num_layers=3, dtype=torch.float32, device="cpu")
    s = c.add_sequence()
    x = torch.randn(1, 5, HKV, D)
    c.append([s], x, x, 0)
    assert c.pages(s) == [0, 1] and [c.seq_len(s, la) for la in range(3)] == [5, 0, 0]
    bt0, sl0 = c.batch([s], 0)
    c.append([s], x, x, 1)
    c.append([s], x, x, 2)
    assert c.pages(s) == [0, 1] and c.num_free_pages == 6, "later layers must not allocate again"
    bt2, sl2 = c.batch([s], 2)
    assert bt2 is bt0 and sl2 is sl0, "nothing changed: batch() must hand back the same tensors"
    assert c.batch([s], 1, max_pages=5)[0].tolist() == [[0, 1, 0, 0, 0]]
    assert c.positions([s], 2, 1).tolist() == [[5, 6]]


def test_fork_between_layers_of_a_step_copies_before_the_next_layer_writes():
    """Layer 1 repeats layer 0's positions, so append reuses layer 0's write plan; a fork in
    between shares the page it targets, and the plan must be remade (copy, then write)."""
    c = PagedKVCache(8, 4, HKV, D, num_layers=2, dtype=torch.float32, device="cpu")
    a = c.add_sequence()
    x = torch.randn(1, 2, HKV, D)
    c.append([a], x, x, 0)
    f = c.fork(a)
    c.append([a], x + 1, x + 1, 1)
    assert c.pages(a) != c.pages(f) and c.refcount(c.pages(a)[0]) == 1 == c.refcount(c.pages(f)[0])
    assert torch.equal(c.k_pages(1)[c.pages(a)[0], :2], x[0] + 1)
    assert torch.equal(c.k_pages(0)[c.pages(a)[0], :2], x[0]), "the copy must carry layer 0"


def test_bad_inputs():
    c = PagedKVCache(4, 2, HKV, D, dtype=torch.float32, device="cpu")
    s = c.add_sequence()
    c.append([s], torch.zeros(1, 3, HKV, D), torch.zeros(1, 3, HKV, D))
    x, x2 = torch.zeros(1, 1, HKV, D), torch.zeros(2, 1, HKV, D)
    cases = [
        (ValueError, "page_size", lambda: PagedKVCache(4, 0, HKV, D)),
        (TypeError, "dtype", lambda: PagedKVCache(4, 2, HKV, D, dtype=torch.int8)),
        (ValueError, "seq_ids", lambda: c.append([s + 1], x, x)),
        (ValueError, "seq_ids", lambda: c.append([s, s], x2, x2)),
        (ValueError, "k: expected shape", lambda: c.append([s], torch.zeros(1, 1, HKV + 1, D), x)),
        (ValueError, "v: shape", lambda: c.append([s], x, torch.zeros(1, 2, HKV, D))),
        (ValueError, "layer", lambda: c.append([s], x, x, 1)),
        (ValueError, "lengths", lambda: c.append([s], x, x, lengths=[2])),
        (ValueError, "lengths", lambda: c.append([s], x, x, lengths=[True])),  # a bool is no count
        (ValueError, "num_tokens", lambda: c.positions([s], True)),
        (ValueError, "rope.rotary_dim", lambda: c.append([s], x, x, rope=RopeConfig(rotary_dim=8))),
        (ValueError, "max_pages", lambda: c.batch([s], max_pages=1)),
        (ValueError, "sid", lambda: c.free(s + 7)),
        (ValueError, "page: expected an int in", lambda: c.refcount(-1)),
        (ValueError, "page: expected an int in", lambda: c.refcount(4)),
        (ValueError, "layer", lambda: PagedKVCache(4, 2, HKV, D, num_layers=2, dtype=torch.float8_e4m3fn,
                                                   device="cpu").k_scale(7)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    assert c.seq_len(s) == 3 and c.pages(s) == [0, 1], "a rejected call must change nothing"


# ---- RoPE on append (both append backends) ---------------------------------------------------

def _ragged_cache(backend, rope, dtype=torch.float32, page_size=3, D_=16, seed=0):
    """Three sequences at different lengths (positions differ per sequence), then a ragged append
    that crosses pages. Returns (cache, ids, model rows of layer 0 before RoPE, k/v of each append)."""
    g = torch.Generator().manual_seed(seed)
    c = PagedKVCache(12, page_size, HKV, D_, dtype=dtype, device="cpu", backend=backend)
    ids = [c.add_sequence() for _ in range(3)]
    raw = {s: [] for s in ids}
    for n_ids, T, lengths in ((3, 4, [4, 1, 0]), (2, 5, [5, 2]), (3, 3, None)):
        k = torch.randn(n_ids, T, HKV, D_, generator=g)
        v = torch.randn(n_ids, T, HKV, D_, generator=g)
        use = ids[:n_ids]
        c.append(use, k, v, rope=rope, lengths=lengths)
        for i, s in enumerate(use):
            m = lengths[i] if lengths is not None else T
            raw[s] += [(k[i, t], v[i, t]) for t in range(m)]
    return c, ids, raw


@pytest.mark.parametrize("style,rotary_dim", [("neox", None), ("gptj", None), ("neox", 8), ("gptj", 4)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_applies_rope_at_each_sequences_positions(style, rotary_dim, backend):
    rope = RopeConfig(rotary_dim=rotary_dim, style=style)
    c, ids, raw = _ragged_cache(backend, rope)
    bt, sl = c.batch(ids)
    for b, s in enumerate(ids):
        L = len(raw[s])
        k = torch.stack([r[0] for r in raw[s]])[None]
        want = rope_reference(k, torch.arange(L)[None], style=style, rotary_dim=rotary_dim)[0]
        torch.testing.assert_close(gather_keys(c.k_pages(), b, L, bt).double(), want, atol=2e-6, rtol=0)
        assert torch.equal(gather_keys(c.v_pages(), b, L, bt), torch.stack([r[1] for r in raw[s]]))


# ---- decode over the cache ---------------------------------------------------------------------

def _decode_setup(backend, dtype, page_size, Hq=4, Hkv=2, Dh=64, seed=0):
    """A cache shaped by continuous batching: ragged prefills, a fork that diverges, a freed
    sequence whose pages get reused (so block tables are not in order), NaN in unwritten slots."""
    g = torch.Generator().manual_seed(seed)
    c = PagedKVCache(128, page_size, Hkv, Dh, dtype=dtype, device="cpu", backend=backend)
    c.k_pages().fill_(float("nan"))
    c.v_pages().fill_(float("nan"))
    rows = {}  # sid -> list of (k [Hkv, D], v [Hkv, D]) in position order

    def add(ids, T, lengths=None):
        k = torch.randn(len(ids), T, Hkv, Dh, generator=g).to(dtype)
        v = torch.randn(len(ids), T, Hkv, Dh, generator=g).to(dtype)
        c.append(ids, k, v, lengths=lengths)
        for i, s in enumerate(ids):
            m = lengths[i] if lengths is not None else T
            rows.setdefault(s, []).extend((k[i, t], v[i, t]) for t in range(m))

    a, b, gone = c.add_sequence(), c.add_sequence(), c.add_sequence()
    add([a, b, gone], 21, [21, 9, 17])
    c.free(gone)
    f = c.fork(a)
    rows[f] = list(rows[a])
    e = c.add_sequence()  # empty: decode gives o = 0, lse = -inf
    add([f, b], 13)
    add([a], 2)
    ids = [f, e, a, b]
    bt, sl = c.batch(ids)
    kd = torch.zeros(len(ids), max(sl.tolist()) + 1, Hkv, Dh, dtype=dtype)
    vd = torch.zeros_like(kd)
    for i, s in enumerate(ids):
        for t, (kr, vr) in enumerate(rows.get(s, [])):
            kd[i, t], vd[i, t] = kr, vr
    q = torch.randn(len(ids), 1, Hq, Dh, generator=g).to(dtype)
    return c, bt, sl, q, kd, vd


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_over_cache_torch_backend(page_size):
    c, bt, sl, q, kd, vd = _decode_setup("torch", torch.float32, page_size)
    assert sl.tolist() == [34, 0, 23, 22]
    o, lse = splitkv.decode(q, c.k_pages(), c.v_pages(), sl, block_table=bt, return_lse=True, backend="torch",
                            num_splits=3)
    assert_close_to_reference(o, lse, q, kd, vd, sl)


def test_decode_over_cache_triton_interpreted():
    c, bt, sl, q, kd, vd = _decode_setup("triton", torch.float16, 16)
    o, lse = splitkv.decode(q, c.k_pages(), c.v_pages(), sl, block_table=bt, return_lse=True,
                            backend="triton")
    assert_close_to_reference(o, lse, q, kd, vd, sl)


# ---- GPU (run on the H200) ---------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_append_then_decode_round_trip():
    dev, Hq, Hkv, Dh, ps = "cuda", 32, 8, 128, 16
    c = PagedKVCache(4096, ps, Hkv, Dh, num_layers=2, dtype=torch.bfloat16, device=dev)
    rope = RopeConfig(base=500000.0)
    lens = [1, 17, 1000, 4097]
    ids = [c.add_sequence() for _ in lens]
    kd = torch.randn(len(ids), max(lens) + 1, Hkv, Dh, device=dev, dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    for layer in range(2):
        c.append(ids, kd[:, :max(lens)], vd[:, :max(lens)], layer, rope=rope, lengths=lens)
    sl_ = torch.tensor(lens, device=dev)
    pos = torch.arange(kd.shape[1], device=dev)[None].expand(len(ids), -1)
    kr = apply_rope(kd, pos, rope)
    q = torch.randn(len(ids), 1, Hq, Dh, device=dev, dtype=torch.bfloat16)
    for layer in range(2):
        bt, sl = c.batch(ids, layer)
        assert torch.equal(sl.long(), sl_)
        o, lse = splitkv.decode(q, c.k_pages(layer), c.v_pages(layer), sl, block_table=bt, return_lse=True)
        assert_close_to_reference(o, lse, q, kr, vd, sl)


def test_integer_arguments_of_any_kind():
    """Page and sequence ids and lengths from NumPy or torch (as a serving loop holds them) work like
    Python ints; bools and floats do not."""
    np = pytest.importorskip("numpy")
    c = PagedKVCache(8, 2, HKV, D, dtype=torch.float32, device="cpu")
    ids = [c.add_sequence() for _ in range(2)]
    c.append(range(2), torch.zeros(2, 3, HKV, D), torch.zeros(2, 3, HKV, D), lengths=np.array([3, 1]))
    assert [c.seq_len(s) for s in ids] == [3, 1]
    page = c.pages(ids[0])[0]
    assert c.refcount(np.int64(page)) == c.refcount(torch.tensor(page)) == c.refcount(page) == 1
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="page"):
            c.refcount(bad)
