"""Shared test data builders, the tolerance rule (ours <= 2x PyTorch's own low-precision error) and the
CuTe DSL skip marker."""

from __future__ import annotations

import math

import pytest
import torch

from splitkv.backends import cutlass
from splitkv.reference import decode_lowp, decode_reference

needs_dsl = pytest.mark.skipif(not cutlass.available(), reason="nvidia-cutlass-dsl not installed "
                                                             "(pip install 'splitkv[cutlass]')")


def make_inputs(B, Sq, Hq, Hkv, D, lens, dtype, device="cpu", *, pad=3, nan_tail=True, seed=0,
                transposed=False):
    """q, k, v (contiguous cache [B, Lmax, Hkv, D]) and int32 lengths. Slots past each length hold
    NaN, so a kernel that reads them poisons its output."""
    g = torch.Generator().manual_seed(seed)
    Lmax = max(max(lens), 1) + pad
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    shape = (B, Hkv, Lmax, D) if transposed else (B, Lmax, Hkv, D)
    k = torch.randn(*shape, generator=g).to(dtype)
    v = torch.randn(*shape, generator=g).to(dtype)
    if transposed:  # [B, Hkv, L, D] storage viewed as [B, L, Hkv, D]: non-contiguous, unit stride on D
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if nan_tail:
        for b, L in enumerate(lens):
            k[b, L:] = float("nan")
            v[b, L:] = float("nan")
    seqlens = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), k.to(device), v.to(device), seqlens.to(device)


def to_paged(k, v, lens, page_size, *, seed=0, extra_pages=3):
    """Scatter a contiguous cache into shuffled pages. Unused pages and page tails hold NaN; block
    table entries past each request's last page hold out-of-range ids (must never be read)."""
    g = torch.Generator().manual_seed(seed + 1)
    B, _, Hkv, D = k.shape
    need = [math.ceil(L / page_size) for L in lens]
    max_pages = max(max(need), 1) + 1
    P = sum(need) + extra_pages
    perm = torch.randperm(P, generator=g)
    kp = torch.full((P, page_size, Hkv, D), float("nan"), dtype=k.dtype)
    vp = torch.full_like(kp, float("nan"))
    bt = torch.full((B, max_pages), P + 1000, dtype=torch.int32)  # garbage past the used pages
    i = 0
    for b, L in enumerate(lens):
        for j in range(need[b]):
            page = int(perm[i])
            i += 1
            bt[b, j] = page
            n = min(page_size, L - j * page_size)
            kp[page, :n] = k[b, j * page_size: j * page_size + n].cpu()
            vp[page, :n] = v[b, j * page_size: j * page_size + n].cpu()
    dev = k.device
    return kp.to(dev), vp.to(dev), bt.to(dev)


LSE_TOL = 2e-3  # |lse - reference| on finite entries, every test of decode


def fp8_bound(ref_max: float) -> float:
    """|o - reference| allowed on an fp8 cache (the reference dequantises exactly): 1% of the
    largest reference output, + 1e-3."""
    return 1e-2 * (ref_max + 1e-6) + 1e-3


def variant_bound(dtype: torch.dtype, fp32: float = 1e-5) -> float:
    """|o - reference| allowed for an attention variant: `fp32` for fp32 inputs, 2e-2 for bf16/fp16."""
    return fp32 if dtype == torch.float32 else 2e-2


def assert_within(o, lse, ro, rl, bound: float) -> None:
    """o within `bound` of the reference output ro, no NaN; lse's inf pattern that of rl, its finite
    entries within LSE_TOL."""
    assert not torch.isnan(o).any(), "NaN in output"
    err = (o.double() - ro).abs().max().item()
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin), "lse -inf pattern differs from the reference"
    if fin.any():
        assert (lse.double()[fin] - rl[fin]).abs().max().item() < LSE_TOL


def assert_close_to_reference(o, lse, q, k, v, seqlens, *, causal=True, block_table=None, lowp_k=None,
                              lowp_v=None, atol=1e-3):
    """o within 2x PyTorch's own low-precision error (+atol) of the fp64 truth; lse close; no NaN."""
    ro, rl = decode_reference(q, k, v, seqlens, causal=causal, block_table=block_table)
    if q.dtype == torch.float32:
        bound = 1e-4
    else:
        kk = lowp_k if lowp_k is not None else k
        vv = lowp_v if lowp_v is not None else v
        base = (decode_lowp(q, torch.nan_to_num(kk), torch.nan_to_num(vv), seqlens, causal=causal).double()
                - ro).abs().max().item()
        bound = 2 * base + atol
    assert_within(o, lse, ro, rl, bound)
    fin = torch.isfinite(rl)
    assert torch.all(lse[~fin] == -math.inf)
    assert torch.all(o.double()[~fin.transpose(1, 2)] == 0), "rows with no visible key must be 0"


def assert_drawn_png(path, min_colors: int = 8) -> None:
    """path is a PNG of a drawn figure (several colours over a real canvas), not an empty one."""
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG" and im.width >= 300 and im.height >= 200, (path, im.size)
        colors = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colors is None or len(colors) >= min_colors, (path, len(colors))
