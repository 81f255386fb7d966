"""NaN and infinity semantics, checked against the fp64 reference.

* NaN in q, or in a key / value a query uses, propagates to that query's o and lse (as SDPA and
  FlashAttention do); it is never turned into an empty row (o = 0, lse = -inf). Other rows are
  unaffected. A row with no visible key is o = 0, lse = -inf, whatever its q holds.
* NaN in unused cache slots never reaches the output (make_inputs fills them with NaN).
* merge_states / the merge: lse = NaN propagates; lse = -inf and lse = +inf (FlashAttention's
  value for a row with no key) are empty (weight 0, o never read); all empty -> o = 0, lse = -inf.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_inputs

import splitkv
from splitkv import backends
from splitkv.backends.triton import merge as triton_merge
from splitkv.merge import merge_states, merge_states_n
from splitkv.reference import decode_reference

NAN, INF = math.nan, math.inf
FP16 = torch.float16
ATOL = 5e-3  # fp16 output of O(1) values vs the fp64 truth

# B = 3: requests 0 and 1 have keys, request 2 has none; Hq = 4 over Hkv = 2 (GQA 2)
B, HQ, HKV, D, LENS = 3, 4, 2, 64, [37, 29, 0]


def _poisoned(Sq=1, device="cpu"):
    """Inputs with NaN in q of (b 0, head 1), in q of the empty request (b 2, head 0), in a used key
    of (b 1, KV head 1) and in one column of a used value of (b 1, KV head 0)."""
    q, k, v, sl = make_inputs(B, Sq, HQ, HKV, D, LENS, FP16)
    q[0, :, 1] = NAN
    q[2, :, 0] = NAN  # no key: still 0 / -inf
    k[1, 5, 1, 7] = NAN  # heads 2, 3 of request 1: o and lse NaN
    v[1, 11, 0, 3] = NAN  # heads 0, 1 of request 1: o[..., 3] NaN, lse finite
    return q.to(device), k.to(device), v.to(device), sl.to(device)


def _check(o, lse, q, k, v, sl, causal=True):
    """o / lse vs the fp64 reference: NaN exactly where the reference has NaN, equal elsewhere."""
    o, lse = o.cpu(), lse.cpu()
    ro, rl = decode_reference(q.cpu(), k.cpu(), v.cpu(), sl.cpu(), causal=causal)
    Sq = q.shape[1]
    # the reference itself: the poisoned rows are NaN, the empty request is 0 / -inf
    assert torch.isnan(ro[0, :, 1]).all() and torch.isnan(rl[0, 1]).all()
    assert torch.isnan(ro[1, :, 2:]).all() and torch.isnan(rl[1, 2:]).all()
    assert torch.isnan(ro[1, :, :2, 3]).all() and not torch.isnan(ro[1, :, :2, :3]).any()
    assert torch.isfinite(rl[1, :2]).all()
    assert torch.all(ro[2] == 0) and torch.all(rl[2] == -INF)
    assert torch.equal(torch.isnan(o), torch.isnan(ro)), "NaN pattern of o differs from the reference"
    assert torch.equal(torch.isnan(lse), torch.isnan(rl)), "NaN pattern of lse differs from the reference"
    ok = ~torch.isnan(ro)
    assert (o.double()[ok] - ro[ok]).abs().max() <= ATOL
    fin = torch.isfinite(rl)
    assert (lse.double()[fin] - rl[fin]).abs().max() <= 2e-3
    assert torch.all(o[2] == 0) and torch.all(lse[2] == -INF), "a request with no key must be 0 / -inf"
    assert lse.shape == (B, HQ, Sq)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("Sq", [1, 2])
def test_torch_backend_nan_propagates(Sq, num_splits):
    q, k, v, sl = _poisoned(Sq)
    o, lse = splitkv.decode(q, k, v, sl, num_splits=num_splits, return_lse=True, backend="torch")
    _check(o, lse, q, k, v, sl)


@pytest.mark.parametrize("L", [1, 5, 15])
@pytest.mark.parametrize("Sq", [1, 3])
def test_torch_backend_nan_propagates_with_few_keys(L, Sq):
    """ATen's CPU flash kernel, under the torch backend's one-pass path, turns a NaN query into
    o = 0, lse = 0 below 16 keys (and a NaN key at one key): those passes take the plain math."""
    for where in ("q", "k"):
        q, k, v, _ = make_inputs(2, Sq, HQ, HKV, D, [L, L], torch.float32)
        sl = torch.tensor([L, L], dtype=torch.int32)
        if where == "q":
            q[0, -1, 1, 0] = NAN
        else:
            k[0, 0, 0, 0] = NAN  # key 0: seen by every query of request 0
        o, lse = splitkv.decode(q, k, v, sl, return_lse=True, backend="torch")
        ro, rl = decode_reference(q, k, v, sl)
        assert torch.equal(torch.isnan(o), torch.isnan(ro)) and torch.equal(torch.isnan(lse), torch.isnan(rl)), where
        assert torch.isnan(lse[0]).any() and not torch.isnan(o[1]).any()
        ok = ~torch.isnan(ro)
        assert (o.double()[ok] - ro[ok]).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if backends.triton_available() else []))
@pytest.mark.parametrize("Sq, L, num_splits", [(3, 8, None), (1, 40, None), (1, 40, 3), (2, 40, 1)])
def test_an_overflowing_score_is_nan_not_an_empty_row(backend, Sq, L, num_splits):
    """Finite inputs whose q . k overflows fp32: the score is +inf, and exp(inf - inf) has no answer.
    The row is NaN (as SDPA gives), never o = 0, lse = -inf (the empty row) nor a result without
    that key: an overflowed lse must not pass for FlashAttention's +inf "no key"."""
    q = torch.zeros(1, Sq, 3, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, L, 1, 64, dtype=torch.bfloat16)
    v = torch.randn(1, L, 1, 64, dtype=torch.bfloat16)
    q[..., 0], k[0, 2, 0, 0] = 1e20, 1e20  # q . k = 1e40 > fp32 max
    o, lse = splitkv.decode(q, k, v, torch.tensor([L], dtype=torch.int32), num_splits=num_splits, return_lse=True,
                            backend=backend)
    assert lse.isnan().all() and o.isnan().all()


def test_reference_keeps_nan_of_a_hidden_value_away():
    """A value a query cannot see (after it, causal; outside its window) never reaches its output in
    the fp64 reference (0 x NaN would be NaN). The kernels' P @ V may let it through, as SDPA's does
    (README: the step's newest keys, Sq > 1)."""
    q, k, v, _ = make_inputs(1, 2, HQ, HKV, D, [8], torch.float32)
    sl = torch.tensor([8], dtype=torch.int32)
    v[0, 7, 0, 0] = NAN  # the newest key: query 1 sees it, query 0 (position 6) does not
    ro, _ = decode_reference(q, k, v, sl, causal=True)
    assert not torch.isnan(ro[0, 0]).any() and torch.isnan(ro[0, 1, :2, 0]).all()
    ro, _ = decode_reference(q, k, v, sl, causal=False, window_size=(-1, 0))  # the right window hides it too
    assert not torch.isnan(ro[0, 0]).any()


# 3 splits: the split kernel's fused merge; 9 (> heuristics.FUSED_MERGE_MAX_SPLITS): the
# merge kernel
@pytest.mark.parametrize("num_splits", [1, 3, 9])
def test_triton_backend_nan_propagates(num_splits):
    q, k, v, sl = _poisoned()
    o, lse = splitkv.decode(q, k, v, sl, num_splits=num_splits, return_lse=True, backend="triton")
    _check(o, lse, q, k, v, sl)


@pytest.mark.parametrize("num_splits", [5, 9, 13])
def test_triton_fused_merge_of_many_splits(num_splits, monkeypatch):
    """The fused merge walks the splits MERGE_UNROLL at a time: split counts that are not a multiple
    of it, with NaN and empty rows, merge like the reference (and like the merge kernel)."""
    from splitkv import heuristics

    q, k, v, sl = make_inputs(B, 1, HQ, HKV, D, [1000, 900, 0], FP16, seed=4)  # up to 15 splits of 64 keys
    q[0, :, 1] = NAN
    k[1, 500, 1, 7] = NAN
    v[1, 11, 0, 3] = NAN
    unfused = splitkv.decode(q, k, v, sl, num_splits=num_splits, return_lse=True, backend="triton")
    monkeypatch.setattr(heuristics, "FUSED_MERGE_MAX_SPLITS", heuristics.MAX_SPLITS)
    splitkv.clear_plans()
    p = splitkv.plan(sl, q.shape[2], k.shape[2], q.shape[3], num_splits=num_splits, backend="triton")
    assert p.fuse and p.max_splits == num_splits
    o, lse = splitkv.decode(q, k, v, sl, plan=p, return_lse=True, backend="triton")
    _check(o, lse, q, k, v, sl)
    assert torch.allclose(o.float(), unfused[0].float(), atol=1e-2, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
@pytest.mark.parametrize("num_splits", [1, 3, 40])
@pytest.mark.parametrize("Sq", [1, 2])
def test_gpu_nan_propagates(backend, num_splits, Sq):
    # on the GPU max drops NaN (maxnumf / fmax): the NaN must still come through the weights
    if backend == "cutlass" and not backends.cutlass_available():
        pytest.skip("cutlass backend not available")
    q, k, v, sl = _poisoned(Sq, device="cuda")
    o, lse = splitkv.decode(q, k, v, sl, num_splits=num_splits, return_lse=True, backend=backend)
    _check(o, lse, q, k, v, sl)


# ---- merge_states / the merge ------------------------------------------------------------------

def _states(N, seed=0):
    """N reference states over disjoint key sets of one request batch, and the union's reference:
    o [N, 2, 1, 4, 64] fp32, lse [N, 2, 4, 1] fp32."""
    g = torch.Generator().manual_seed(seed)
    Bm, Hq, Dm, L = 2, 4, 64, 40 * N
    q = torch.randn(Bm, 1, Hq, Dm, generator=g)
    k = torch.randn(Bm, L, Hq, Dm, generator=g)
    v = torch.randn(Bm, L, Hq, Dm, generator=g)
    lens = torch.full((Bm,), 40, dtype=torch.int32)
    os_, ls_ = [], []
    for i in range(N):
        o, lse = decode_reference(q, k[:, 40 * i:40 * (i + 1)], v[:, 40 * i:40 * (i + 1)], lens, causal=False)
        os_.append(o.float())
        ls_.append(lse.float())
    ro, rl = decode_reference(q, k, v, torch.full((Bm,), L, dtype=torch.int32), causal=False)
    return torch.stack(os_), torch.stack(ls_), ro, rl


def test_merge_nan_lse_propagates():
    o, lse, _, _ = _states(2, seed=1)
    lse[1, 0, 2, 0] = NAN  # state 1, request 0, head 2
    out, out_lse = merge_states(o[0], lse[0], o[1], lse[1])
    assert torch.isnan(out[0, 0, 2]).all() and torch.isnan(out_lse[0, 2, 0])
    # the other rows: the reference merge of the two (untouched) states, by the formula
    m = torch.maximum(lse[0], lse[1]).double()
    wa, wb = torch.exp(lse[0].double() - m), torch.exp(lse[1].double() - m)
    wa_t, wb_t = wa.transpose(1, 2)[..., None], wb.transpose(1, 2)[..., None]  # [B, Sq, Hq, 1]
    want = (wa_t * o[0] + wb_t * o[1]) / (wa_t + wb_t)
    ok = torch.ones_like(out_lse, dtype=torch.bool)
    ok[0, 2, 0] = False
    assert not torch.isnan(out_lse[ok]).any()
    assert (out_lse[ok].double() - (m + torch.log(wa + wb))[ok]).abs().max() < 1e-5
    okt = ok.transpose(1, 2)
    assert (out.double()[okt] - want[okt]).abs().max() < 1e-5


def test_merge_n_nan_lse_propagates_and_others_equal_union():
    o, lse, ro, rl = _states(3, seed=2)
    lse[2, 1, 0, 0] = NAN
    out, out_lse = merge_states_n(o, lse)
    assert torch.isnan(out[1, 0, 0]).all() and torch.isnan(out_lse[1, 0, 0])
    ok = torch.ones_like(out_lse, dtype=torch.bool)
    ok[1, 0, 0] = False
    assert not torch.isnan(out_lse[ok]).any()
    assert (out_lse[ok].double() - rl[ok]).abs().max() < 1e-5
    okt = ok.transpose(1, 2)
    assert (out.double()[okt] - ro[okt]).abs().max() < 1e-5


@pytest.mark.parametrize("empty", [INF, -INF])
def test_merge_inf_lse_is_empty(empty):
    o, lse, _, _ = _states(2, seed=3)
    o_e = torch.full_like(o[1], NAN)  # an empty state's o may hold anything: never read
    lse_e = torch.full_like(lse[1], empty)
    for out, out_lse in (merge_states(o[0], lse[0], o_e, lse_e), merge_states(o_e, lse_e, o[0], lse[0])):
        assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
        assert torch.allclose(out, o[0], atol=1e-6) and torch.allclose(out_lse, lse[0], atol=1e-6)


def test_merge_both_empty_is_zero_neg_inf():
    o, lse, _, _ = _states(2, seed=4)
    o_e = torch.full_like(o[0], NAN)
    for la, lb in ((INF, INF), (INF, -INF), (-INF, INF), (-INF, -INF)):
        out, out_lse = merge_states(o_e, torch.full_like(lse[0], la), o_e.clone(), torch.full_like(lse[0], lb))
        assert torch.all(out == 0) and torch.all(out_lse == -INF), (la, lb)
    # N-way, mixed per row: request 0 all empty (+inf / -inf), request 1 one live state
    lse_n = torch.stack([lse[0], lse[1]]).clone()
    lse_n[0, 0], lse_n[1, 0] = INF, -INF
    lse_n[1, 1] = INF
    o_n = torch.stack([o[0], o_e])
    out, out_lse = merge_states_n(o_n, lse_n)
    assert torch.all(out[0] == 0) and torch.all(out_lse[0] == -INF)
    assert torch.allclose(out[1], o[0, 1], atol=1e-6) and torch.allclose(out_lse[1], lse[0, 1], atol=1e-6)


def _merge_cases():
    """(o_part [S, B, H, T, D], lse_part [S, B, H, T]) with, per row of request 0: head 0 a NaN
    partial, head 1 a +inf partial with NaN o, head 2 every partial empty (+inf / -inf, NaN o),
    head 3 clean; request 1 clean. Returns the partials and the expected (o, lse) by the formula."""
    o, lse, _, _ = _states(3, seed=5)
    o_part = o.permute(0, 1, 3, 2, 4).contiguous()  # [S, B, H, T, D]
    l_part = lse.clone()
    l_part[1, 0, 0, 0] = NAN
    l_part[2, 0, 1, 0] = INF
    o_part[2, 0, 1, 0] = NAN
    l_part[:, 0, 2, 0] = torch.tensor([INF, -INF, INF])
    o_part[:, 0, 2, 0] = NAN
    return o_part, l_part


def _check_merge(out, out_lse, o_part, l_part, atol=1e-5):
    o_part, l_part = o_part.double(), l_part.double()
    assert torch.isnan(out[0, 0, 0]).all() and torch.isnan(out_lse[0, 0, 0])  # NaN partial
    assert torch.all(out[0, 0, 2] == 0) and out_lse[0, 2, 0] == -INF  # all empty
    # head 1: split 2 (+inf) is empty -> merge of splits 0 and 1 only
    lse01 = torch.logsumexp(l_part[:2, 0, 1, 0], 0)
    want = (torch.exp(l_part[:2, 0, 1, 0] - lse01)[:, None] * o_part[:2, 0, 1, 0]).sum(0)
    assert (out[0, 0, 1].double() - want).abs().max() < atol and abs(out_lse[0, 1, 0] - lse01) < 1e-5
    for b, h in ((0, 3), (1, 0), (1, 1), (1, 2), (1, 3)):
        lt = torch.logsumexp(l_part[:, b, h, 0], 0)
        want = (torch.exp(l_part[:, b, h, 0] - lt)[:, None] * o_part[:, b, h, 0]).sum(0)
        assert (out[b, 0, h].double() - want).abs().max() < atol and abs(out_lse[b, h, 0] - lt) < 1e-5


def test_torch_merge_nan_and_inf_partials():
    o_part, l_part = _merge_cases()
    out, out_lse = torch.empty(2, 1, 4, 64), torch.empty(2, 4, 1)
    backends.get("torch").merge(o_part, l_part, torch.full((2,), 3, dtype=torch.int32), out, out_lse)
    _check_merge(out, out_lse, o_part, l_part)


def test_triton_merge_nan_and_inf_partials():
    o_part, l_part = _merge_cases()
    out, out_lse = torch.empty(2, 1, 4, 64), torch.empty(2, 4, 1)
    triton_merge(o_part, l_part, torch.full((2,), 3, dtype=torch.int32), out, out_lse)
    _check_merge(out, out_lse, o_part, l_part)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
def test_gpu_merge_nan_and_inf_partials(backend):
    if backend == "cutlass" and not backends.cutlass_available():
        pytest.skip("cutlass backend not available")
    o_part, l_part = _merge_cases()
    out = torch.empty(2, 1, 4, 64, device="cuda", dtype=torch.float16 if backend == "cutlass" else torch.float32)
    out_lse = torch.empty(2, 4, 1, device="cuda")
    backends.get(backend).merge(o_part.cuda(), l_part.cuda(), torch.full((2,), 3, dtype=torch.int32, device="cuda"),
                                  out, out_lse)
    _check_merge(out.float().cpu(), out_lse.cpu(), o_part, l_part, atol=2e-3 if backend == "cutlass" else 1e-5)
