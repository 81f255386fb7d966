"""The Triton append kernel (splitkv/backends/triton/append_kernel.py) against append_torch, its
PyTorch spec: interpreted at tiny sizes on the CPU, at real sizes on the GPU.

Interpreted cases use fp32 / fp16 pools, not bf16: the interpreter rounds fp32 -> bf16 toward zero
(on a GPU the cast is round-to-nearest-even), so a bf16 pool would differ by an ulp by design."""

from __future__ import annotations

import math

import pytest
import torch

from splitkv.backends.triton.append_kernel import append_kv
from splitkv.cache import append_torch
from splitkv.rope import RopeConfig, rope_tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rope", [None, RopeConfig(style="neox", rotary_dim=8), RopeConfig(style="gptj")])
def test_triton_append_equals_torch_append(dtype, rope):
    g = torch.Generator().manual_seed(7)
    P, ps, H, Dh = 6, 4, 3, 16  # H = 3: a partial head block
    pools = [torch.full((P, ps, H, Dh), float("nan"), dtype=dtype) for _ in range(4)]
    k = torch.randn(2, 6, H, Dh, generator=g)  # fp32 in, `dtype` pool: the kernel casts on store
    v = torch.randn(2, 6, H, Dh, generator=g)
    pages = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    starts = torch.tensor([2, 9], dtype=torch.int32)  # seq 1 starts in its 3rd page (position 9)
    ntok = torch.tensor([6, 3], dtype=torch.int32)
    cos = sin = None
    if rope is not None:
        cos, sin = rope_tables(rope, 16, Dh, "cpu")
    neox = rope.neox if rope is not None else True
    append_torch(pools[0], pools[1], k, v, pages, starts, ntok, cos, sin, neox=neox)
    append_kv(pools[2], pools[3], k, v, pages, starts, ntok, cos, sin, neox=neox)
    torch.testing.assert_close(pools[2], pools[0], equal_nan=True, atol=1e-6, rtol=0)
    torch.testing.assert_close(pools[3], pools[1], equal_nan=True, atol=0, rtol=0)
    assert torch.isnan(pools[0][0, 0]).all() and not torch.isnan(pools[0][4, 2:]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("rope", [None, RopeConfig(style="neox"), RopeConfig(style="gptj", rotary_dim=64)])
@pytest.mark.parametrize("N,T", [(256, 1), (4, 1000)])
def test_gpu_append_kernel_equals_torch_append(rope, N, T):
    dev, P, ps, H, Dh = "cuda", 4096, 16, 8, 128
    k = torch.randn(N, T, H, Dh, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    need = math.ceil((T + 15) / ps)
    pages = torch.randperm(P, device=dev)[:N * need].view(N, need).int()
    starts = torch.randint(0, ps, (N,), device=dev, dtype=torch.int32)
    ntok = torch.randint(1, T + 1, (N,), device=dev, dtype=torch.int32)
    cos, sin = rope_tables(rope, 2048, Dh, dev) if rope is not None else (None, None)
    neox = rope.neox if rope is not None else True
    ref = [torch.zeros(P, ps, H, Dh, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    got = [torch.zeros_like(ref[0]) for _ in range(2)]
    append_torch(*ref, k, v, pages, starts, ntok, cos, sin, neox=neox)
    append_kv(*got, k, v, pages, starts, ntok, cos, sin, neox=neox)
    # fp32 math on both sides; an FMA may move a bf16 rounding by one ulp
    torch.testing.assert_close(got[0], ref[0], atol=1e-2, rtol=2 ** -7)
    assert torch.equal(got[1], ref[1])
