"""Providers: splitkv's backends and the peers, behind one small interface.

    p.unavailable()         -> reason it cannot run on this machine at all (listed as skipped), or None
    p.unsupported(case)     -> reason it cannot take this shape/layout (row marked n/a), or None
    s = p.session(case, graph=False|True)   one-time set-up outside any timed region (plans, layout
                                            copies, wrappers); s.context() is held around timing
    fn = s.bind(tensor_set) -> zero-arg callable running one decode, returning o [B, Sq, Hq, D]

The same fn is timed three ways by the runner: eager (GPU time, L2 flushed), host (CPU time of the
launch loop) and, for a graph session, under CUDA-graph replay.

Peers are given what their API takes and nothing is emulated: a peer with no paged-KV input, no
per-request lengths or no GQA for a shape is n/a for it (SDPA backends that reject GQA raise
"no available kernel" on the first call; the runner turns that into n/a, never into an expanded K/V).
Each provider allocates its own output on every call, as a caller would.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import splitkv

from .. import backends
from ..constants import FP8_HEAD_DIMS, HEAD_DIMS
from .inputs import Case, TensorSet


class NotApplicable(Exception):
    """Raised by a session or the first call when the provider cannot take this case."""


class Session:
    plan_text: str | None = None
    note: str = ""

    def context(self):
        return contextlib.nullcontext()

    def bind(self, ts: TensorSet):
        raise NotImplementedError

    def close(self) -> None:
        pass


class Provider:
    name = ""
    kind = "peer"  # "splitkv" or "peer"
    graphable = True
    graph_note = "not graph-capturable"  # the row's note when graph timing is skipped for it

    def unavailable(self) -> str | None:
        return None

    def unsupported(self, case: Case) -> str | None:
        return None

    def session(self, case: Case, graph: bool) -> Session:
        raise NotImplementedError


# ---------------------------------------------------------------- splitkv
class _SplitKVSession(Session):
    """Plan reused: made once outside the timed region (graph rows: graph-safe, refreshed once)."""

    def __init__(self, backend: str, case: Case, graph: bool, num_splits: int | None):
        s, ts = case.shape, case.base
        bound = s.max_seqlen if graph else None
        self.kw = case.call_kwargs  # variant rows: the variant; fp8 rows: the scales
        self.plan = splitkv.plan(ts.cache_seqlens, s.num_q_heads, s.num_kv_heads, s.head_dim, q_len=s.q_len,
                                 num_splits=num_splits, max_seqlen=bound, backend=backend, paged=s.paged,
                                 kv_dtype=ts.k_cache.dtype, **self.kw)
        if graph:
            self.plan.refresh(ts.cache_seqlens)  # once per step, as a server does before replaying
        self.backend, self.causal = backend, s.causal
        self.plan_text = self.plan.describe()
        self.note = "graph-safe plan" if graph else "plan made once, reused"

    def bind(self, ts: TensorSet):
        p, backend, causal, kw = self.plan, self.backend, self.causal, self.kw
        return lambda: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, block_table=ts.block_table,
                                      causal=causal, plan=p, backend=backend, **kw)


class _SplitKVNoPlanSession(Session):
    """No plan: `splitkv.decode(q, k, v, lens, backend=...)`, exactly what a new user calls; whatever
    decode does to plan for itself is inside every timed call (graph rows: inside the capture)."""

    note = "no plan: decode(q, k, v, lens)"

    def __init__(self, backend: str, case: Case, num_splits: int | None):
        s = case.shape
        self.backend, self.causal, self.num_splits, self.kw = backend, s.causal, num_splits, case.call_kwargs
        try:  # what decode would plan, for --explain (made here, never inside the timed calls)
            p = splitkv.plan(case.base.cache_seqlens, s.num_q_heads, s.num_kv_heads, s.head_dim, q_len=s.q_len,
                             num_splits=num_splits, backend=backend, paged=s.paged,
                             kv_dtype=case.base.k_cache.dtype, **self.kw)
            self.plan_text = "decode plans itself, like " + p.describe()
        except Exception as exc:  # noqa: BLE001 - display only
            self.plan_text = f"decode plans itself ({type(exc).__name__} describing it: {exc})"

    def bind(self, ts: TensorSet):
        backend, causal, n, kw = self.backend, self.causal, self.num_splits, self.kw
        return lambda: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, block_table=ts.block_table,
                                      causal=causal, num_splits=n, backend=backend, **kw)


NOPLAN = "-noplan"  # provider-name suffix of the no-plan mode: splitkv-<backend>-noplan


class SplitKV(Provider):
    """splitkv.decode with one backend, in one of two calling modes.

    plan mode (splitkv-<backend>): the plan is made once per row outside the timed region and
    reused by every call, as every layer of a real decode step reuses it: eager rows use an eager
    plan (from the actual lengths), graph rows a graph-safe plan (max_seqlen = longest request,
    refreshed once before capture).
    no-plan mode (splitkv-<backend>-noplan): `decode(q, k, v, lens, backend=...)` with no plan,
    the README's first example, eager and, since a plain decode is capturable (after one call on
    the capture stream outside capture: timing.time_graph warms up on it), under graph replay."""

    kind = "splitkv"

    def __init__(self, backend: str, num_splits: int | None = None, noplan: bool = False):
        self.backend, self.num_splits, self.noplan = backend, num_splits, noplan
        self.name = f"splitkv-{backend}" + (NOPLAN if noplan else "")
        # the torch backend sizes its padded grid from device values on the host: not capturable
        self.graphable = backend != "torch"

    def unavailable(self) -> str | None:
        if self.backend == "cutlass" and not backends.cutlass_available():
            return "needs nvidia-cutlass-dsl and splitkv.backends.cutlass"
        if self.backend == "triton" and not backends.triton_available():
            return "triton is not installed"
        return None

    def unsupported(self, case: Case) -> str | None:
        try:
            backends.resolve(self.backend, case.device)
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        s = case.shape
        if self.backend == "cutlass" and (s.head_dim not in (FP8_HEAD_DIMS if s.kv_dtype else HEAD_DIMS)):
            return f"cutlass runs head dims {HEAD_DIMS}, fp8 KV at {FP8_HEAD_DIMS}"
        return None

    def session(self, case: Case, graph: bool) -> Session:
        if self.noplan:
            session = _SplitKVNoPlanSession(self.backend, case, self.num_splits)
            if graph:
                session.note = "no plan, captured: decode(q, k, v, lens) in a CUDA graph"
            return session
        return _SplitKVSession(self.backend, case, graph, self.num_splits)


# ---------------------------------------------------------------- torch SDPA
def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


class _SDPASession(Session):
    def __init__(self, which: str, case: Case):
        from torch.nn.attention import sdpa_kernel

        s = case.shape
        self.which, self.case = which, case
        self._ctx = lambda: sdpa_kernel([_sdpa_backends()[which]])
        self.gqa = s.num_q_heads != s.num_kv_heads
        self.mask = None
        self.flash_causal = False
        if s.q_len > 1 and s.causal:
            L, Sq = s.max_seqlen, s.q_len
            if which == "flash" and case.device.type == "cuda":
                # FA2 takes no mask; its own causal flag is bottom-right aligned when Sq < L, the
                # public SDPA flag is top-left, so the aten op is called directly (checked by the
                # error column against the reference).
                self.flash_causal = True
                self.note = "aten flash op, causal (bottom-right)"
            else:
                qpos = torch.arange(Sq, device=case.device)[:, None] + (L - Sq)
                self.mask = torch.arange(L, device=case.device)[None, :] <= qpos  # bool [Sq, L]
                self.note = "bool mask [Sq, L] (bottom-right causal)"
        self._layout: dict[int, tuple] = {}

    def context(self):
        return self._ctx()

    def _tensors(self, ts: TensorSet):
        key = id(ts)
        if key not in self._layout:  # SDPA's layout [B, H, L, D], copied once outside timing
            L = self.case.shape.max_seqlen
            self._layout[key] = (ts.q.transpose(1, 2).contiguous(),
                                 ts.k_cache[:, :L].transpose(1, 2).contiguous(),
                                 ts.v_cache[:, :L].transpose(1, 2).contiguous())
        return self._layout[key]

    def bind(self, ts: TensorSet):
        q, k, v = self._tensors(ts)
        if self.flash_causal:
            flash = torch.ops.aten._scaled_dot_product_flash_attention
            return lambda: flash(q, k, v, 0.0, True, False)[0].transpose(1, 2)
        mask, gqa = self.mask, self.gqa
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)

    def close(self) -> None:
        self._layout.clear()


class SDPA(Provider):
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend with sdpa_kernel."""

    def __init__(self, which: str):
        self.which = which
        self.name = f"sdpa-{which}"

    def unavailable(self) -> str | None:
        try:
            _sdpa_backends()
        except ImportError as exc:
            return f"torch.nn.attention not importable: {exc}"
        if self.which != "flash" and not torch.cuda.is_available():
            return "needs CUDA"
        return None

    def unsupported(self, case: Case) -> str | None:
        if case.shape.kv_dtype:
            return "no fp8 KV with bf16 q"
        if not case.shape.plain:
            return "no window / softcap / sinks / ALiBi arguments"
        if case.shape.paged:
            return "no paged KV input"
        if not case.shape.uniform:
            return "no per-request lengths (a padding mask would read Lmax for every request)"
        if case.device.type != "cuda" and self.which != "flash":
            return "needs CUDA"
        return None

    def session(self, case: Case, graph: bool) -> Session:
        return _SDPASession(self.which, case)


def is_rejection(exc: BaseException) -> bool:
    """A first-call failure that means 'this kernel does not take this problem' (-> n/a)."""
    msg = str(exc).lower()
    return (isinstance(exc, (NotApplicable, NotImplementedError)) or "no available kernel" in msg
            or "no viable backend" in msg)

