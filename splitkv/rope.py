"""Rotary position embedding (RoPE) in PyTorch: the config, cos/sin tables, and the rotation.

Shared by PagedKVCache (which rotates K on append) and by callers (who rotate q with the same
`apply_rope`), so q and K always see the same angles.

Math: for frequency j < rotary_dim / 2, theta_j = base ** (-2j / rotary_dim); the pair (a, b) of
dims j at position p becomes (a cos(p theta_j) - b sin(p theta_j), b cos(p theta_j) + a sin(p theta_j)).
Which dims form pair j is the style:
  * "neox" (rotate-half; Llama, NeoX, Qwen, Mistral): (j, j + rotary_dim / 2);
  * "gptj" (interleaved; GPT-J, ChatGLM): (2j, 2j + 1).
Dims >= rotary_dim pass through unchanged (partial rotary: rotary_dim <= head_dim).

Angles are computed in float64 and cos/sin rounded to float32, whether on the fly
(`apply_rope`) or as tables (`rope_tables`), so both give bitwise the same cos/sin for a position;
the rotation itself runs in float32 and is rounded to the input dtype once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STYLES = ("neox", "gptj")


@dataclass(frozen=True, eq=False)
class RopeConfig:
    """How to rotate: either computed frequencies (base, rotary_dim) or caller tables (cos, sin).

    rotary_dim: dims rotated, even, <= head_dim; None = the whole head (or 2 x the tables' width).
    base: theta base (10000 for Llama 2, 500000 for Llama 3 before its frequency scaling).
    style: "neox" (rotate-half) or "gptj" (interleaved pairs).
    cos, sin: optional float tables [max_positions, rotary_dim // 2] (e.g. with YaRN / Llama-3
        scaling already applied; for a Hugging Face [max_pos, rotary_dim] table pass
        cos[:, :rotary_dim // 2] for neox, cos[:, ::2] for gptj). Given tables override base.
    """

    rotary_dim: int | None = None
    base: float = 10000.0
    style: str = "neox"
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"rope.style: expected one of {STYLES}, got {self.style!r}")
        if self.rotary_dim is not None and (not isinstance(self.rotary_dim, int) or self.rotary_dim <= 0
                                            or self.rotary_dim % 2):
            raise ValueError(f"rope.rotary_dim: expected None or a positive even int, "
                             f"got {self.rotary_dim!r}")
        if not (isinstance(self.base, (int, float)) and self.base > 0):
            raise ValueError(f"rope.base: expected a positive number, got {self.base!r}")
        if (self.cos is None) != (self.sin is None):
            raise ValueError("rope.cos, rope.sin: give both tables or neither")
        if self.cos is not None:
            for name, t in (("cos", self.cos), ("sin", self.sin)):
                if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                    raise ValueError(f"rope.{name}: expected a float tensor [max_positions, rotary_dim // 2]")
            if self.cos.shape != self.sin.shape:
                raise ValueError(f"rope.sin: shape {tuple(self.sin.shape)} does not match rope.cos's "
                                 f"{tuple(self.cos.shape)}")
            if self.rotary_dim is not None and self.cos.shape[1] * 2 != self.rotary_dim:
                raise ValueError(f"rope.cos: width {self.cos.shape[1]} != rotary_dim // 2 "
                                 f"= {self.rotary_dim // 2}")

    @property
    def neox(self) -> bool:
        return self.style == "neox"

    def resolve_dim(self, head_dim: int) -> int:
        """rotary_dim for heads of head_dim, checked against it."""
        r = self.cos.shape[1] * 2 if self.cos is not None else (self.rotary_dim or head_dim)
        if r > head_dim or r % 2:
            raise ValueError(f"rope.rotary_dim: {r} must be even and <= head_dim {head_dim}")
        return r

    def inv_freq(self, rotary_dim: int, device: torch.device | str | None) -> torch.Tensor:
        """theta_j = base ** (-2j / rotary_dim), float64 [rotary_dim // 2]."""
        j = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device)
        return self.base ** (-j / rotary_dim)


def _check_rope(rope) -> RopeConfig:
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"rope: expected a splitkv.RopeConfig, got {type(rope).__name__}")
    return rope


def rope_cos_sin(rope: RopeConfig, positions: torch.Tensor, head_dim: int):
    """cos, sin float32 [*positions.shape, rotary_dim // 2] at integer positions."""
    rope = _check_rope(rope)
    r = rope.resolve_dim(head_dim)
    if rope.cos is not None:
        n = rope.cos.shape[0]
        # checked on the host only: on CUDA the check would sync every call (an out-of-range
        # index still fails there, as a device-side indexing assert)
        if positions.device.type == "cpu" and positions.numel() and (
                int(positions.min()) < 0 or int(positions.max()) >= n):
            raise ValueError(f"positions: must lie in [0, {n}) (rows of rope.cos), got "
                             f"[{int(positions.min())}, {int(positions.max())}]")
        idx = positions.to(rope.cos.device).long()
        return (rope.cos[idx].float().to(positions.device), rope.sin[idx].float().to(positions.device))
    ang = positions.to(torch.float64)[..., None] * rope.inv_freq(r, positions.device)
    return torch.cos(ang).float(), torch.sin(ang).float()


def rope_tables(rope: RopeConfig, num_positions: int, head_dim: int, device):
    """cos, sin float32 contiguous [num_positions, rotary_dim // 2] on device (row p = position p)."""
    pos = torch.arange(num_positions, device=device)
    cos, sin = rope_cos_sin(rope, pos, head_dim)
    return cos.contiguous(), sin.contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [..., H, D] rotated by cos/sin [..., rotary_dim // 2] (broadcast over heads); x.dtype out."""
    half = cos.shape[-1]
    r = 2 * half
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    if neox:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Rotate x [..., H, D] (e.g. q [B, Sq, Hq, D]) at integer positions broadcastable to
    x.shape[:-2] (e.g. [B, Sq]); returns a new tensor in x's dtype.

    For decode, the positions of q are those its tokens take in the cache:
    `PagedKVCache.positions(seq_ids, Sq, layer)` before the append, i.e. cache_seqlens - Sq + i
    after it.
    """
    rope = _check_rope(rope)
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise TypeError("x: expected a float tensor [..., H, D]")
    positions = torch.as_tensor(positions, device=x.device)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"positions: expected an integer tensor, got {positions.dtype}")
    lead = x.shape[:-2]
    try:
        ok = torch.broadcast_shapes(positions.shape, lead) == lead
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"positions: shape {tuple(positions.shape)} does not broadcast to x's leading "
                         f"dims {tuple(lead)}")
    cos, sin = rope_cos_sin(rope, positions.expand(lead), x.shape[-1])
    return rotate(x, cos, sin, rope.neox)
