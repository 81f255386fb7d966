"""attend_new_keys (the step's own keys folded into a cache state) against decode over the cache
with those keys appended; the Triton kernel runs interpreted on the CPU, natively on the GPU."""

import math

import pytest
import torch

import splitkv
from splitkv.backends.triton import extend as triton_extend
from splitkv.extend import attend_new_keys


def _triton(o, lse, q, nk, nv, causal, scale):
    out, lse_out = torch.empty_like(o), torch.empty_like(lse)
    triton_extend(q, nk, nv, o, lse, out, lse_out, scale, causal)
    return out, lse_out


def _torch(o, lse, q, nk, nv, causal, scale):
    return attend_new_keys(o, lse, q, nk, nv, causal=causal, softmax_scale=scale)


IMPLS = {"torch": _torch, "triton": _triton}


def _case(B, Sq, Hq, Hkv, D, lens, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    L = max(lens) + Sq
    q = torch.randn(B, Sq, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(B, L, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(B, L, Hkv, D, generator=g).to(device, dtype)
    for b, n in enumerate(lens):  # the step's keys sit right after each request's cache
        k[b, n:n + Sq] = k[b, L - Sq:]
        v[b, n:n + Sq] = v[b, L - Sq:]
    nk, nv = k[:, L - Sq:], v[:, L - Sq:]
    cached = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k, v, nk, nv, cached


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("B,Sq,Hq,Hkv,D,lens,causal", [
    (1, 1, 4, 2, 64, [37], True),
    (3, 4, 6, 2, 80, [5, 0, 130], True),   # request 1 has no cached key: the old state is empty
    (2, 3, 8, 8, 40, [17, 64], False),
    (2, 16, 4, 1, 128, [1, 300], True),
])
def test_equals_decode_over_the_cache_plus_the_new_keys(impl, B, Sq, Hq, Hkv, D, lens, causal):
    q, k, v, nk, nv, cached = _case(B, Sq, Hq, Hkv, D, lens)
    scale = 0.7 / math.sqrt(D)
    o, lse = splitkv.decode(q, k, v, cached, causal=False, softmax_scale=scale, return_lse=True, backend="torch")
    got_o, got_lse = IMPLS[impl](o, lse, q, nk, nv, causal, scale)
    if causal:
        want_o, want_lse = splitkv.decode(q, k, v, cached + Sq, causal=True, softmax_scale=scale, return_lse=True,
                                          backend="torch")
    else:  # every query sees all Sq new keys: decode without a mask over the whole extended cache
        want_o, want_lse = splitkv.decode(q, k, v, cached + Sq, causal=False, softmax_scale=scale,
                                          return_lse=True, backend="torch")
    torch.testing.assert_close(got_o, want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_states_and_nan(impl):
    B, Sq, Hq, Hkv, D = 1, 2, 4, 2, 64
    q, k, v, nk, nv, cached = _case(B, Sq, Hq, Hkv, D, [8])
    o = torch.full((B, Sq, Hq, D), float("nan"))  # an empty state's o is never read
    lse = torch.full((B, Hq, Sq), float("-inf"))
    lse[0, 1] = float("inf")  # FlashAttention's "no key": empty too
    lse[0, 2, 0] = float("nan")  # a NaN state propagates to its row only
    got_o, got_lse = IMPLS[impl](o, lse, q, nk, nv, True, 1 / 8)
    want_o, want_lse = splitkv.decode(q, nk.contiguous(), nv.contiguous(), torch.tensor([Sq], dtype=torch.int32),
                                      causal=True, softmax_scale=1 / 8, return_lse=True, backend="torch")
    keep = torch.ones(Hq, dtype=torch.bool)
    keep[2] = False
    torch.testing.assert_close(got_o[:, :, keep], want_o[:, :, keep], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_lse[:, keep], want_lse[:, keep], atol=2e-5, rtol=2e-5)
    assert torch.isnan(got_lse[0, 2, 0]) and torch.isnan(got_o[0, 0, 2]).all()
    assert not torch.isnan(got_o[0, 1, 2]).any()  # token 1's state of head 2 was a clean -inf


def test_bad_shapes_name_the_argument():
    q, k, v, nk, nv, cached = _case(1, 2, 4, 2, 64, [8])
    o, lse = torch.zeros_like(q), torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="new_k"):
        attend_new_keys(o, lse, q, nk[:, :1], nv[:, :1])
    with pytest.raises(ValueError, match="new_k"):
        attend_new_keys(o, lse, q, nk[:, :, :1].expand(1, 2, 3, 64), nv[:, :, :1].expand(1, 2, 3, 64))
    with pytest.raises(ValueError, match="lse"):
        attend_new_keys(o, lse[:, :, :1], q, nk, nv)
    with pytest.raises(ValueError, match="^o:"):
        attend_new_keys(o[:, :1], lse, q, nk, nv)
    with pytest.raises(TypeError, match="new_k: expected a torch.Tensor"):
        attend_new_keys(o, lse, q, nk.tolist(), nv)
    with pytest.raises(TypeError, match="lse: expected a torch.Tensor"):
        attend_new_keys(o, None, q, nk, nv)
    with pytest.raises(TypeError, match="new_v: dtype"):
        attend_new_keys(o, lse, q, nk, nv.double())
    with pytest.raises(TypeError, match="causal"):
        attend_new_keys(o, lse, q, nk, nv, causal=1)
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="softmax_scale"):
            attend_new_keys(o, lse, q, nk, nv, softmax_scale=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_the_torch_path(dtype):
    q, k, v, nk, nv, cached = _case(4, 3, 32, 8, 128, [1000, 1, 4096, 77], device="cuda", dtype=dtype)
    o, lse = splitkv.decode(q, k, v, cached, causal=False, return_lse=True)
    got_o, got_lse = attend_new_keys(o, lse, q, nk, nv)
    want_o, want_lse = splitkv.decode(q, k, v, cached + 3, causal=True, return_lse=True)
    ref_o, _ = attend_new_keys(o.cpu(), lse.cpu(), q.cpu(), nk.cpu(), nv.cpu())
    torch.testing.assert_close(got_o.float(), ref_o.float().cuda(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_o.float(), want_o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-3, rtol=1e-3)
