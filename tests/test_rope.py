"""splitkv.rope against a straightforward per-pair reference (fp64), both styles, partial rotary."""

from __future__ import annotations

import math

import pytest
import torch

from splitkv.rope import RopeConfig, apply_rope, rope_cos_sin, rope_tables


def rope_reference(x, positions, *, style, rotary_dim=None, base=10000.0):
    """Rotate x [N, T, H, D] pair by pair in float64, with the pairing written out per style."""
    N, T, H, D = x.shape
    r = rotary_dim or D
    out = x.double().clone()
    xd = x.double()
    for n in range(N):
        for t in range(T):
            p = int(positions[n, t])
            for j in range(r // 2):
                ang = p * base ** (-2 * j / r)
                a_i, b_i = (j, j + r // 2) if style == "neox" else (2 * j, 2 * j + 1)
                a, b = xd[n, t, :, a_i], xd[n, t, :, b_i]
                out[n, t, :, a_i] = a * math.cos(ang) - b * math.sin(ang)
                out[n, t, :, b_i] = b * math.cos(ang) + a * math.sin(ang)
    return out


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 8, 2])  # whole head, partial, a single pair
def test_apply_rope_matches_reference(style, rotary_dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2, 16, generator=g)
    pos = torch.tensor([[0, 1, 17], [4096, 65537, 3]])
    cfg = RopeConfig(rotary_dim=rotary_dim, style=style)
    got = apply_rope(x, pos, cfg)
    want = rope_reference(x, pos, style=style, rotary_dim=rotary_dim)
    assert got.dtype == x.dtype and got.shape == x.shape
    # cos/sin are fp32-rounded and the rotation runs in fp32: ~1e-7 relative per term
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
    r = rotary_dim or 16
    assert torch.equal(got[..., r:], x[..., r:]), "dims past rotary_dim must pass through untouched"


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_low_precision_rounds_once(style):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 4, 64, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 100000, (3, 5), generator=g)
    got = apply_rope(x, pos, RopeConfig(base=500000.0, style=style))
    want = rope_reference(x.float(), pos, style=style, base=500000.0)
    # one rounding of an accurate fp32 value: within one bf16 ulp (2^-7 relative) of the truth
    err = (got.double() - want).abs()
    assert torch.all(err <= want.abs() * 2 ** -7 + 1e-6)


def test_positions_broadcast_and_q_layout():
    """q [B, Sq, Hq, D] with positions [B, 1] (one per request) equals per-token positions."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 1, 8, 32, generator=g)
    cfg = RopeConfig()
    pos = torch.tensor([[5], [0], [123]])
    torch.testing.assert_close(apply_rope(q, pos, cfg), apply_rope(q, pos.expand(3, 1).clone(), cfg))
    torch.testing.assert_close(apply_rope(q, pos, cfg).double(), rope_reference(q, pos, style="neox"),
                               atol=2e-6, rtol=0)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_scores_depend_only_on_relative_position(style):
    """The point of RoPE: <rope(q, m), rope(k, n)> is a function of m - n."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 1, 32, generator=g).double()
    k = torch.randn(1, 1, 1, 32, generator=g).double()
    cfg = RopeConfig(style=style)
    dots = [(apply_rope(q.float(), torch.tensor([[m + 7]]), cfg).double()
             * apply_rope(k.float(), torch.tensor([[m]]), cfg).double()).sum().item() for m in (0, 100, 3000)]
    assert max(dots) - min(dots) < 1e-4


def test_tables_equal_on_the_fly_bitwise():
    """The cache indexes tables, callers use apply_rope: both must see the same cos/sin."""
    cfg = RopeConfig(rotary_dim=24, base=10000.0, style="gptj")
    cos_t, sin_t = rope_tables(cfg, 70000, 32, "cpu")
    assert cos_t.shape == (70000, 12) and cos_t.dtype == torch.float32 and cos_t.is_contiguous()
    pos = torch.tensor([[0, 1, 65535, 69999]])
    cos, sin = rope_cos_sin(cfg, pos, 32)
    assert torch.equal(cos, cos_t[pos]) and torch.equal(sin, sin_t[pos])


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_caller_tables(style):
    """Tables given by the caller are used as is (here: made by a hypothetical scaled rope)."""
    g = torch.Generator().manual_seed(5)
    ang = torch.arange(50, dtype=torch.float64)[:, None] * torch.rand(1, 4, generator=g, dtype=torch.float64)
    cfg = RopeConfig(style=style, cos=ang.cos().float(), sin=ang.sin().float())
    x = torch.randn(1, 2, 3, 16, generator=g)
    pos = torch.tensor([[3, 49]])
    got = apply_rope(x, pos, cfg)
    want = x.double().clone()
    for t in range(2):
        a_idx = [0, 1, 2, 3] if style == "neox" else [0, 2, 4, 6]
        for j, a_i in enumerate(a_idx):
            b_i = a_i + 4 if style == "neox" else a_i + 1
            c, s = ang[pos[0, t], j].cos(), ang[pos[0, t], j].sin()
            a, b = x.double()[0, t, :, a_i], x.double()[0, t, :, b_i]
            want[0, t, :, a_i], want[0, t, :, b_i] = a * c - b * s, b * c + a * s
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(x, torch.tensor([[3, 50]]), cfg)


def test_bad_inputs():
    with pytest.raises(ValueError, match="rope.style"):
        RopeConfig(style="llama")
    with pytest.raises(ValueError, match="rope.rotary_dim"):
        RopeConfig(rotary_dim=7)
    with pytest.raises(ValueError, match="rope.base"):
        RopeConfig(base=0)
    with pytest.raises(ValueError, match="rope.cos"):
        RopeConfig(cos=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="rope.sin"):
        RopeConfig(cos=torch.zeros(4, 2), sin=torch.zeros(4, 3))
    x = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="rope.rotary_dim"):
        apply_rope(x, torch.zeros(2, 3, dtype=torch.long), RopeConfig(rotary_dim=16))
    with pytest.raises(ValueError, match="positions"):
        apply_rope(x, torch.zeros(3, 2, dtype=torch.long), RopeConfig())
    with pytest.raises(TypeError, match="positions"):
        apply_rope(x, torch.zeros(2, 3), RopeConfig())
    with pytest.raises(TypeError, match="rope"):
        apply_rope(x, torch.zeros(2, 3, dtype=torch.long), {"base": 10000})
