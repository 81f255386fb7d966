"""The torch backend's two paths: `run_fast` (ATen's CPU flash kernel, one pass per request) and
`run_spec` (the vectorised split/merge spec). They must give the same results to rounding on
every input the contract covers — dense and paged (shuffled pages, garbage table entries),
GQA / MQA / MHA, causal Sq up to 16, empty requests and rows, NaN — so the two cannot drift; and
`run` must pick the spec path exactly where partials are observable."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_to_reference, make_inputs, to_paged

import splitkv
from splitkv.backends import torch_backend as tb
from splitkv.reference import decode_reference

NAN, INF = math.nan, math.inf
# |fast - spec|: both are fp32 softmaxes of the same scores; the fast path rounds o to q's dtype once
# (twice on the causal Sq > 1 merge), the spec once after its fp32 merge: a couple of ulps
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _both(q, k, v, sl, bt=None, *, causal=True, scale=None, num_splits=3, out_fast=None):
    """(o, lse) of the fast path (auto plan) and of the spec path (a plan with num_splits splits)."""
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    res = []
    for path, splits in ((tb.run_fast, None), (tb.run_spec, num_splits)):
        p = splitkv.plan(sl, Hq, Hkv, D, q_len=Sq, num_splits=splits, backend="torch", paged=bt is not None,
                         max_seqlen=max(int(sl.max()), 1))
        o = out_fast if (path is tb.run_fast and out_fast is not None) else torch.empty_like(q)
        lse = torch.empty(B, Hq, Sq)
        if path is tb.run_fast:
            path(q, k, v, sl, bt, p, o, lse, scale, causal)
        else:
            path(q, k, v, sl, bt, p, p.o_part, p.lse_part, o, lse, scale, causal)
        res.append((o, lse))
    return res


def _same(fast, spec, dtype):
    (o_f, l_f), (o_s, l_s) = fast, spec
    # empty rows (-inf), NaN rows: the same pattern, exactly
    assert torch.equal(torch.isnan(o_f), torch.isnan(o_s)) and torch.equal(torch.isnan(l_f), torch.isnan(l_s))
    assert torch.equal(l_f == -INF, l_s == -INF)
    assert torch.all(o_f.transpose(1, 2)[l_f == -INF] == 0)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(o_f, o_s, rtol=rtol, atol=atol, equal_nan=True)
    fin = torch.isfinite(l_s)
    torch.testing.assert_close(l_f[fin], l_s[fin], rtol=0, atol=2e-5 if dtype == torch.float32 else 2e-4)


CASES = [  # B, Sq, Hq, Hkv, D, lens
    (3, 1, 8, 2, 64, [300, 0, 37]),  # GQA 4, an empty request
    (2, 1, 4, 4, 128, [513, 1]),  # MHA, one key
    (4, 1, 8, 1, 64, [100, 100, 100, 100]),  # MQA, a uniform batch (one kernel call)
    (2, 4, 8, 2, 64, [260, 3]),  # causal Sq 4: request 1 has fewer keys than queries (empty rows)
    (2, 16, 4, 2, 64, [400, 16]),  # causal Sq 16 (speculative verify), request 1 exactly Sq keys
    (1, 3, 16, 2, 256, [77]),  # D 256, GQA 8
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-{c[2]}x{c[3]}-d{c[4]}")
@pytest.mark.parametrize("layout", ["dense", "transposed", "paged16", "paged64-inorder"])
def test_fast_path_equals_spec_path(case, dtype, layout):
    B, Sq, Hq, Hkv, D, lens = case
    q, k, v, sl = make_inputs(B, Sq, Hq, Hkv, D, lens, dtype, transposed=layout == "transposed", seed=B + Sq)
    bt = None
    if layout == "paged16":  # shuffled pages, NaN page tails, garbage table entries past the last page
        k, v, bt = to_paged(k, v, lens, 16)
    elif layout == "paged64-inorder":  # consecutive pages: the fast path reads them in place
        k, v, bt = _inorder_pages(k, v, lens, 64)
    for causal in (True, False) if Sq > 1 else (True,):
        fast, spec = _both(q, k, v, sl, bt, causal=causal)
        _same(fast, spec, dtype)
        if layout == "dense":
            assert_close_to_reference(*fast, q, k, v, sl, causal=causal, block_table=bt)


def _inorder_pages(k, v, lens, ps):
    """Each request's keys on consecutive pages (request after request), table garbage past them."""
    kp, vp, rows, start = [], [], [], 0
    for b, L in enumerate(lens):
        n = -(-L // ps)
        pad = n * ps - L
        kp.append(torch.cat([k[b, :L], torch.full_like(k[b, :pad], NAN)]))
        vp.append(torch.cat([v[b, :L], torch.full_like(v[b, :pad], NAN)]))
        rows.append(list(range(start, start + n)))
        start += n
    bt = torch.full((len(lens), max(map(len, rows)) + 1), 10 ** 6, dtype=torch.int32)
    for b, r in enumerate(rows):
        bt[b, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return torch.cat(kp).unflatten(0, (-1, ps)), torch.cat(vp).unflatten(0, (-1, ps)), bt


def test_fast_path_page_order_does_not_change_bits():
    # in place (consecutive pages), gathered (shuffled pages) and dense: the same kernel on the same
    # values in the same order
    lens = [300, 129]
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, lens, torch.bfloat16)
    dense = _both(q, k, v, sl)[0]
    kp, vp, bt = to_paged(k, v, lens, 16)
    shuffled = _both(q, kp, vp, sl, bt)[0]
    kc, vc, bt = _inorder_pages(k, v, lens, 16)
    inorder = _both(q, kc, vc, sl, bt)[0]
    for o, lse in (shuffled, inorder):
        assert torch.equal(o, dense[0]) and torch.equal(lse, dense[1])


@pytest.mark.parametrize("Sq", [1, 4])
def test_fast_path_nan_semantics(Sq):
    """NaN in q / a used key / a used value reaches exactly the rows that use it; NaN in the newest
    key's K (hidden from the earlier queries of a causal block) and in unused slots reaches nothing.
    (A NaN in V at a hidden key is outside the contract: 0 * NaN in P @ V lets it through in the
    reference, the spec path and the kernels depending on where tiles / splits fall.)"""
    B, Hq, Hkv, D, lens = 3, 4, 2, 64, [37, 29, 0]
    q, k, v, sl = make_inputs(B, Sq, Hq, Hkv, D, lens, torch.float16)
    q[0, :, 1] = NAN
    q[2, :, 0] = NAN  # no key: still 0 / -inf
    k[1, 5, 1, 7] = NAN
    v[1, 11, 0, 3] = NAN
    k[0, 36, 0, 0] = NAN  # request 0's newest key: with Sq = 4 only its last query sees it
    fast, spec = _both(q, k, v, sl)
    _same(fast, spec, torch.float16)
    ro, rl = decode_reference(q, k, v, sl)
    o, lse = fast
    assert torch.equal(torch.isnan(o), torch.isnan(ro)) and torch.equal(torch.isnan(lse), torch.isnan(rl))
    if Sq > 1:
        assert not torch.isnan(o[0, :-1, 0]).any() and torch.isnan(o[0, -1, 0]).all()
    assert torch.all(o[2] == 0) and torch.all(lse[2] == -INF)


def test_fast_path_empty_rows_and_requests():
    # causal Sq 8 over 3 keys: queries 0..4 see nothing (0 / -inf), 5..7 see 1..3 keys
    q, k, v, sl = make_inputs(2, 8, 4, 2, 64, [3, 0], torch.float32)
    (o, lse), spec = _both(q, k, v, sl)
    _same((o, lse), spec, torch.float32)
    assert torch.all(o[0, :5] == 0) and torch.all(lse[0, :, :5] == -INF)
    assert torch.isfinite(lse[0, :, 5:]).all() and torch.all(o[1] == 0) and torch.all(lse[1] == -INF)
    assert_close_to_reference(o, lse, q, k, v, sl)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fast_path_extreme_logits_give_exactly_v(dtype):
    B, Hq, Hkv, D, L = 2, 8, 2, 128, 1000
    q = torch.full((B, 1, Hq, D), 64.0, dtype=dtype)
    k = torch.full((B, L, Hkv, D), -64.0, dtype=dtype)
    v = torch.ones(B, L, Hkv, D, dtype=dtype)
    (o, lse), _ = _both(q, k, v, torch.tensor([L, 333], dtype=torch.int32))
    assert torch.equal(o, torch.ones_like(o)) and torch.isfinite(lse).all()


def test_fast_path_is_batch_invariant_and_deterministic():
    lens = [700, 33, 2100, 700]
    q, k, v, sl = make_inputs(4, 1, 8, 2, 128, lens, torch.bfloat16)
    o, lse = splitkv.decode(q, k, v, sl, backend="torch", batch_invariant=True, return_lse=True)
    o2, lse2 = splitkv.decode(q, k, v, sl, backend="torch", batch_invariant=True, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    for b in range(4):
        ob, lb = splitkv.decode(q[b:b + 1], k[b:b + 1], v[b:b + 1], sl[b:b + 1], backend="torch",
                                batch_invariant=True, return_lse=True)
        assert torch.equal(ob[0], o[b]) and torch.equal(lb[0], lse[b])


def test_fast_path_writes_strided_out():
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [50, 50], torch.float32)
    out = torch.zeros(2, 8, 1, 64).transpose(1, 2)  # [B, Sq, Hq, D] view, not contiguous
    (o, lse), spec = _both(q, k, v, sl, out_fast=out)
    assert o is out
    _same((o, lse), spec, torch.float32)


def test_run_picks_spec_path_where_partials_are_observable(monkeypatch):
    calls = []
    monkeypatch.setattr(tb, "run_fast", lambda *a: calls.append("fast"))
    monkeypatch.setattr(tb, "run_spec", lambda *a: calls.append("spec"))
    q, k, v, sl = make_inputs(1, 1, 8, 2, 64, [2000], torch.float32)
    splitkv.decode(q, k, v, sl, backend="torch")
    splitkv.decode(q, k, v, sl, backend="torch", num_splits=1)
    splitkv.decode(q, k, v, sl, backend="torch", num_splits=4)
    with splitkv.debug.capture_partials():
        splitkv.decode(q, k, v, sl, backend="torch")
    assert calls == ["fast", "fast", "spec", "spec"]


def test_captured_partials_merge_to_the_output():
    # under capture_partials an auto plan that splits runs the spec path: its partials are real
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [3000, 900], torch.float32)
    with splitkv.debug.capture_partials() as recs:
        o, lse = splitkv.decode(q, k, v, sl, backend="torch", return_lse=True)
    rec = recs[0]
    assert rec.o_part is not None and int(rec.num_splits.max()) > 1
    out, out_lse = torch.empty_like(o), torch.empty_like(lse)
    tb.merge(rec.o_part, rec.lse_part, rec.num_splits, out, out_lse)
    assert torch.equal(out, o) and torch.equal(out_lse, lse)
    fast = splitkv.decode(q, k, v, sl, backend="torch", return_lse=True)
    _same(fast, (o, lse), torch.float32)
