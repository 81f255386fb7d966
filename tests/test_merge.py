"""merge_states / merge_states_n: states of disjoint key sets merge into the fp64 reference state
of their union; empty states weigh nothing; inputs are checked by name."""

from __future__ import annotations

import math

import pytest
import torch

from splitkv.backends.triton import merge as triton_merge
from splitkv.merge import merge_states, merge_states_n
from splitkv.reference import decode_reference

NEG_INF = -math.inf


def _keys(B, L, Hkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, Hkv, D, generator=g), torch.randn(B, L, Hkv, D, generator=g)


def _partition(q, k, v, lens, parts, seed=0):
    """Scatter every request's keys at random over `parts` caches; returns the per-part reference
    states (o [N, B, Sq, Hq, D] fp32, lse [N, B, Hq, Sq] fp32) and the whole-set reference."""
    g = torch.Generator().manual_seed(seed)
    B, L, Hkv, D = k.shape
    owner = torch.randint(0, parts, (B, L), generator=g)
    os_, ls_ = [], []
    for p in range(parts):
        kp, vp = torch.zeros_like(k), torch.zeros_like(v)
        n = []
        for b in range(B):
            idx = torch.nonzero(owner[b, :lens[b]] == p).flatten()
            kp[b, :len(idx)], vp[b, :len(idx)] = k[b, idx], v[b, idx]
            n.append(len(idx))
        o, lse = decode_reference(q, kp, vp, torch.tensor(n, dtype=torch.int32), causal=False)
        os_.append(o.float())
        ls_.append(lse.float())
    ro, rl = decode_reference(q, k, v, torch.tensor(lens, dtype=torch.int32), causal=False)
    return torch.stack(os_), torch.stack(ls_), ro, rl


def _check(o, lse, ro, rl, atol):
    assert not torch.isnan(o).any() and lse.dtype == torch.float32
    assert (o.double() - ro).abs().max() <= atol
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse.double()[fin] - rl[fin]).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_merge_two_equals_union(dtype, atol):
    B, Sq, Hq, Hkv, D = 3, 2, 8, 2, 64
    lens = [113, 1, 0]
    q = torch.randn(B, Sq, Hq, D, generator=torch.Generator().manual_seed(1))
    k, v = _keys(B, 113, Hkv, D, 2)
    o_parts, l_parts, ro, rl = _partition(q, k, v, lens, 2)
    o, lse = merge_states(o_parts[0].to(dtype), l_parts[0], o_parts[1].to(dtype), l_parts[1])
    assert o.dtype == dtype and o.shape == (B, Sq, Hq, D) and lse.shape == (B, Hq, Sq)
    _check(o, lse, ro, rl, atol)
    assert torch.all(o[2] == 0) and torch.all(lse[2] == NEG_INF)  # two empty states: 0, -inf


def test_empty_state_contributes_nothing_and_is_never_read():
    B, Sq, Hq, D = 2, 1, 4, 64
    g = torch.Generator().manual_seed(5)
    o_a, lse_a = torch.randn(B, Sq, Hq, D, generator=g), torch.randn(B, Hq, Sq, generator=g)
    o_b = torch.full_like(o_a, float("nan"))  # an empty state's o may hold anything
    lse_b = torch.full_like(lse_a, NEG_INF)
    for o, lse in (merge_states(o_a, lse_a, o_b, lse_b), merge_states(o_b, lse_b, o_a, lse_a)):
        assert torch.allclose(o, o_a, atol=1e-6) and torch.allclose(lse, lse_a, atol=1e-6)
    o, lse = merge_states(o_b, lse_b, o_b.clone(), lse_b.clone())
    assert torch.all(o == 0) and torch.all(lse == NEG_INF)


def test_merge_equal_states_adds_log2():
    g = torch.Generator().manual_seed(6)
    o_a, lse_a = torch.randn(1, 3, 4, 64, generator=g), torch.randn(1, 4, 3, generator=g) * 10
    o, lse = merge_states(o_a, lse_a, o_a, lse_a)
    assert torch.allclose(o, o_a, atol=1e-6) and torch.allclose(lse, lse_a + math.log(2), atol=1e-5)


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_merge_n_equals_union(parts):
    B, Sq, Hq, Hkv, D = 2, 3, 7, 1, 128
    lens = [300, 5]  # with 7 parts some of request 1's parts are empty
    q = torch.randn(B, Sq, Hq, D, generator=torch.Generator().manual_seed(parts))
    k, v = _keys(B, 300, Hkv, D, 3)
    o_parts, l_parts, ro, rl = _partition(q, k, v, lens, parts, seed=parts)
    o, lse = merge_states_n(o_parts, l_parts)
    _check(o, lse, ro, rl, 1e-5)


def test_merge_n_is_order_free_and_pairwise_consistent():
    B, Sq, Hq, Hkv, D = 2, 1, 4, 2, 64
    q = torch.randn(B, Sq, Hq, D, generator=torch.Generator().manual_seed(8))
    k, v = _keys(B, 90, Hkv, D, 9)
    o_parts, l_parts, ro, rl = _partition(q, k, v, [90, 40], 3)
    o3, l3 = merge_states_n(o_parts, l_parts)
    o_ab, l_ab = merge_states(o_parts[0], l_parts[0], o_parts[1], l_parts[1])
    o2, l2 = merge_states(o_ab, l_ab, o_parts[2], l_parts[2])
    perm = torch.tensor([2, 0, 1])
    o_p, l_p = merge_states_n(o_parts[perm], l_parts[perm])
    for o, lse in ((o2, l2), (o_p, l_p)):
        assert torch.allclose(o, o3, atol=1e-6) and torch.allclose(lse, l3, atol=1e-6)


def test_triton_merge_reads_the_strided_view_merge_passes():
    # merge_states_n hands the merge o [N, B, Sq, Hq, D] permuted to [N, B, Hq, Sq, D] (no copy);
    # the Triton kernel (interpreted here) must honour those strides as the GPU path does
    B, Sq, Hq, Hkv, D = 2, 2, 4, 2, 64
    q = torch.randn(B, Sq, Hq, D, generator=torch.Generator().manual_seed(10))
    k, v = _keys(B, 70, Hkv, D, 11)
    o_parts, l_parts, ro, rl = _partition(q, k, v, [70, 0], 3)
    o_parts[:, 1] = float("nan")  # request 1 has no key: every part is -inf and never read
    view = o_parts.permute(0, 1, 3, 2, 4)
    assert not view.is_contiguous()
    out, lse = torch.empty(B, Sq, Hq, D), torch.empty(B, Hq, Sq)
    triton_merge(view, l_parts, torch.full((B,), 3, dtype=torch.int32), out, lse)
    _check(out, lse, ro, rl, 1e-5)


def test_merge_compiles_without_graph_break():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(12)
    o = torch.randn(3, 2, 1, 4, 64, generator=g)
    lse = torch.randn(3, 2, 4, 1, generator=g)
    lse[1, 0] = NEG_INF

    def f(o, lse):
        a, la = merge_states(o[0], lse[0], o[1], lse[1])
        return merge_states_n(torch.stack((a, o[2])), torch.stack((la, lse[2])))

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(o, lse)
    want = merge_states_n(o, lse)
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-6)


def test_merge_validates_inputs_by_name():
    o = torch.zeros(2, 1, 4, 64)
    lse = torch.zeros(2, 4, 1)
    with pytest.raises(ValueError, match="o_b"):
        merge_states(o, lse, torch.zeros(2, 1, 4, 128), lse)
    with pytest.raises(TypeError, match="o_b"):
        merge_states(o, lse, o.half(), lse)
    with pytest.raises(ValueError, match="lse_b"):
        merge_states(o, lse, o, torch.zeros(2, 1, 4))
    with pytest.raises(TypeError, match="lse_a"):
        merge_states(o, [0.0], o, lse)
    with pytest.raises(ValueError, match="o_a"):
        merge_states(o[0], lse, o, lse)
    with pytest.raises(ValueError, match="o:"):
        merge_states_n(o, lse)
    with pytest.raises(ValueError, match="lse:"):
        merge_states_n(o[None], lse)
    with pytest.raises(ValueError, match="N >= 1"):
        merge_states_n(o[None][:0], lse[None][:0])


@pytest.mark.gpu
def test_gpu_merge_bf16_equals_union():
    B, Sq, Hq, Hkv, D = 4, 1, 32, 8, 128
    lens = [2000, 0, 17, 999]
    q = torch.randn(B, Sq, Hq, D, generator=torch.Generator().manual_seed(13))
    k, v = _keys(B, 2000, Hkv, D, 14)
    o_parts, l_parts, ro, rl = _partition(q, k, v, lens, 5)
    o, lse = merge_states_n(o_parts.cuda().bfloat16(), l_parts.cuda())
    _check(o.cpu(), lse.cpu(), ro, rl, 2e-2)
    o_parts, l_parts, ro, rl = _partition(q, k, v, lens, 2)
    o, lse = merge_states(o_parts[0].cuda(), l_parts[0].cuda(), o_parts[1].cuda(), l_parts[1].cuda())
    _check(o.cpu(), lse.cpu(), ro, rl, 1e-5)
