"""splitkv.decode on the torch and (interpreted) Triton backends against the fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_to_reference, make_inputs, to_paged

import splitkv
from splitkv.reference import decode_reference

BF16, FP16 = torch.bfloat16, torch.float16

# (B, Sq, Hq, Hkv, D, lens, num_splits, causal, dtype). Odd sizes on purpose; ragged batches with
# 0-length rows; GQA 1, 4, 7, 8; forced splits 1, 2, 3, 17.
CASES = [
    (1, 1, 4, 4, 64, [1], None, True, FP16),
    (2, 1, 8, 2, 64, [17, 113], None, True, BF16),
    (3, 1, 7, 1, 64, [0, 1000, 17], None, True, FP16),
    (2, 2, 16, 2, 128, [113, 4097], 3, True, BF16),
    (2, 3, 14, 2, 64, [1000, 0], 17, True, FP16),
    (1, 4, 8, 2, 64, [1000], 2, False, BF16),
    (2, 4, 4, 1, 64, [3, 2], 1, True, FP16),  # Sq > L: the first queries see nothing
    (1, 1, 8, 1, 256, [113], 3, True, BF16),
    (1, 2, 8, 8, 128, [1000], None, True, FP16),
]

# The interpreter runs every program in Python: the Triton grid is trimmed to the cases that cover
# each feature once (GQA 7/8, D 64/128/256, Sq > 1 causal and not, forced and planned splits).
TRITON_CASES = [CASES[i] for i in (1, 2, 3, 4, 5, 6, 7)]


@pytest.mark.parametrize("case", CASES)
def test_torch_backend_matches_reference(case):
    B, Sq, Hq, Hkv, D, lens, ns, causal, dt = case
    q, k, v, sl = make_inputs(B, Sq, Hq, Hkv, D, lens, dt)
    o, lse = splitkv.decode(q, k, v, sl, causal=causal, num_splits=ns, return_lse=True, backend="torch")
    assert o.dtype == dt and o.shape == q.shape and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    assert_close_to_reference(o, lse, q, k, v, sl, causal=causal)


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_backend_matches_reference(case):
    B, Sq, Hq, Hkv, D, lens, ns, causal, dt = case
    q, k, v, sl = make_inputs(B, Sq, Hq, Hkv, D, lens, dt)
    o, lse = splitkv.decode(q, k, v, sl, causal=causal, num_splits=ns, return_lse=True, backend="triton")
    assert_close_to_reference(o, lse, q, k, v, sl, causal=causal)


def test_torch_backend_float32():
    q, k, v, sl = make_inputs(2, 2, 8, 2, 64, [300, 7], torch.float32)
    o, lse = splitkv.decode(q, k, v, sl, num_splits=3, return_lse=True)
    assert_close_to_reference(o, lse, q, k, v, sl)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16, 24, 64, 128])  # 128: a key tile inside one page; 24: not a power of 2
def test_paged_equals_reference_and_contiguous(backend, page_size):
    lens = [0, 113, 250] if page_size > 1 else [0, 37, 20]
    q, k, v, sl = make_inputs(3, 2, 8, 2, 64, lens, BF16)
    kp, vp, bt = to_paged(k, v, lens, page_size)
    o, lse = splitkv.decode(q, kp, vp, sl, block_table=bt, num_splits=3, return_lse=True, backend=backend)
    assert_close_to_reference(o, lse, q, kp, vp, sl, block_table=bt, lowp_k=k, lowp_v=v)
    oc = splitkv.decode(q, k, v, sl, num_splits=3, backend=backend)
    assert torch.allclose(o.float(), oc.float(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_noncontiguous_cache_view(backend):
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [100, 33], FP16, transposed=True)
    assert not k.is_contiguous() and k.stride(-1) == 1
    o, lse = splitkv.decode(q, k, v, sl, num_splits=2, return_lse=True, backend=backend)
    assert_close_to_reference(o, lse, q, k, v, sl)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_split_invariants(backend):
    q, k, v, sl = make_inputs(2, 2, 8, 2, 64, [700, 129], BF16)
    outs = {n: splitkv.decode(q, k, v, sl, num_splits=n, return_lse=True, backend=backend) for n in (1, 2, 3, 17)}
    # 17 splits over 129 keys: most splits are empty (-inf partials) and must weigh nothing
    o1, l1 = outs[1]
    for n, (o, lse) in outs.items():
        assert not torch.isnan(o).any()
        assert (o.float() - o1.float()).abs().max().item() <= 2 ** -6, f"num_splits={n} differs"
        assert (lse - l1).abs().max().item() < 1e-4
    again = splitkv.decode(q, k, v, sl, num_splits=3, return_lse=True, backend=backend)
    assert torch.equal(again[0], outs[3][0]) and torch.equal(again[1], outs[3][1]), "not deterministic"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_split_equals_unsplit_path(backend):
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [200, 50], FP16)
    auto = splitkv.plan(sl, 8, 2, 64, backend=backend)  # short requests: the planner does not split
    assert auto.max_splits == 1
    o_auto = splitkv.decode(q, k, v, sl, plan=auto, backend=backend)
    o_one = splitkv.decode(q, k, v, sl, num_splits=1, backend=backend)
    assert torch.equal(o_auto, o_one)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_rows_zero_and_neg_inf(backend):
    q, k, v, sl = make_inputs(3, 4, 4, 2, 64, [0, 2, 300], FP16)
    o, lse = splitkv.decode(q, k, v, sl, num_splits=2, return_lse=True, backend=backend)
    assert torch.all(o[0] == 0) and torch.all(lse[0] == -math.inf)
    # request 1 has 2 keys and 4 queries: queries 0 and 1 (positions -2, -1) see nothing
    assert torch.all(o[1, :2] == 0) and torch.all(lse[1, :, :2] == -math.inf)
    assert torch.isfinite(lse[1, :, 2:]).all() and torch.isfinite(lse[2]).all()
    assert not torch.isnan(o).any()


def test_out_parameter_and_workspace_reuse():
    q, k, v, sl = make_inputs(1, 1, 8, 2, 64, [2000], BF16)
    out = torch.empty_like(q)
    p = splitkv.plan(sl, 8, 2, 64, num_sms=64)
    assert p.max_splits > 1
    res = splitkv.decode(q, k, v, sl, out=out, plan=p, backend="torch")
    assert res is out
    ptr = p.partials()[0].data_ptr()
    splitkv.decode(q, k, v, sl, out=out, plan=p, backend="torch")
    assert p.partials()[0].data_ptr() == ptr and ptr % 128 == 0
    ro, _ = decode_reference(q, k, v, sl)
    assert (out.double() - ro).abs().max() < 2e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_safe_plan_follows_new_lengths(backend):
    """A graph-safe plan refreshes its split table from device lengths at each call."""
    q, k, v, sl = make_inputs(2, 1, 8, 2, 64, [900, 60], BF16, nan_tail=False)
    p = splitkv.plan(sl, 8, 2, 64, max_seqlen=k.shape[1], num_sms=64, backend=backend)
    assert p.graph_safe and p.max_splits > 1
    for lens in ([900, 60], [17, 903], [0, 5]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        o, lse = splitkv.decode(q, k, v, sl, plan=p, return_lse=True, backend=backend)
        assert_close_to_reference(o, lse, q, k, v, sl)  # stale split counts: still exact
        p.refresh(sl)
        want = splitkv.heuristics.schedule(sl.cpu(), p.rule)
        assert p.num_splits.tolist() == want[0].tolist() and p.chunk_lens.tolist() == want[1].tolist()
        o, lse = splitkv.decode(q, k, v, sl, plan=p, return_lse=True, backend=backend)
        assert_close_to_reference(o, lse, q, k, v, sl)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_extreme_logits_equal_scores_give_exactly_v(backend):
    """FlashInfer's extreme-negative-logits case: q = 64, K = -64, V = 1 (fp16): every score is the
    same huge negative number, so the softmax is uniform and o must be exactly 1."""
    B, Hq, Hkv, D, L = 2, 8, 2, 128, 1000
    q = torch.full((B, 1, Hq, D), 64.0, dtype=FP16)
    k = torch.full((B, L, Hkv, D), -64.0, dtype=FP16)
    v = torch.ones(B, L, Hkv, D, dtype=FP16)
    sl = torch.tensor([L, 333], dtype=torch.int32)
    for splits in (1, 3):
        o, lse = splitkv.decode(q, k, v, sl, num_splits=splits, return_lse=True, backend=backend)
        assert torch.equal(o, torch.ones_like(o)) and torch.isfinite(lse).all()
