"""Peers from other packages: FlashInfer, flash-attn (FA2 / FA3), flex_attention. Each is skipped
(and listed) when it cannot be imported; none is a dependency of splitkv."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from .inputs import Case, TensorSet, page_view
from .providers import NotApplicable, Provider, Session

# FlashInfer's documented workspace size ("the recommended size is 128MB").
FLASHINFER_WORKSPACE_BYTES = 128 * 2**20


def _missing(module: str) -> str | None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module} is not importable"


# ---------------------------------------------------------------- FlashInfer
class _FlashInferSession(Session):
    """Plan once per row (the wrapper's plan/run split), `run` timed. Sq = 1 uses
    BatchDecodeWithPagedKVCacheWrapper (use_tensor_cores for GQA, as FlashInfer advises); Sq > 1
    (speculative verify) uses BatchPrefillWithPagedKVCacheWrapper with causal=True, whose mask is
    bottom-right aligned. Graph rows use wrappers built with use_cuda_graph=True."""

    def __init__(self, case: Case, graph: bool):
        import flashinfer

        s = case.shape
        self.shape = s
        _, _, indptr, indices, last = page_view(case.base, s)
        page_size = s.page_size or 16
        dev = case.device
        ws = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        B = s.batch
        if s.q_len == 1:
            tc = s.num_q_heads != s.num_kv_heads
            kw = {}
            if graph:
                kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty_like(indptr),
                          paged_kv_indices_buffer=torch.empty_like(indices),
                          paged_kv_last_page_len_buffer=torch.empty_like(last))
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc, **kw)
            var = {}  # its sliding window and logit softcap (sinks / ALiBi slopes: n/a, see unsupported)
            if s.window_left >= 0:
                var["window_left"] = s.window_left
            if s.softcap:
                var["logits_soft_cap"] = s.softcap
            self.wrapper.plan(indptr, indices, last, s.num_q_heads, s.num_kv_heads, s.head_dim, page_size,
                              pos_encoding_mode="NONE", q_data_type=case.dtype,
                              kv_data_type=case.base.k_cache.dtype, **var)
            self.note = "decode wrapper, " + ("tensor cores" if tc else "CUDA cores")
        else:
            if s.kv_dtype or not s.plain:
                raise NotApplicable("fp8 KV / variants: compared through the decode wrapper only (Sq = 1)")
            qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * s.q_len
            kw = {}
            if graph:
                kw = dict(use_cuda_graph=True, qo_indptr_buf=torch.empty_like(qo_indptr),
                          paged_kv_indptr_buf=torch.empty_like(indptr),
                          paged_kv_indices_buf=torch.empty_like(indices),
                          paged_kv_last_page_len_buf=torch.empty_like(last))
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)
            self.wrapper.plan(qo_indptr, indptr, indices, last, s.num_q_heads, s.num_kv_heads, s.head_dim,
                              page_size, causal=True, q_data_type=case.dtype, kv_data_type=case.dtype)
            self.note = "prefill wrapper, causal"
        self._ws = ws
        self.kw = case.kv_kwargs  # fp8: run(..., k_scale=, v_scale=), FlashInfer's per-tensor scales

    def bind(self, ts: TensorSet):
        s, kw = self.shape, self.kw
        k_pages, v_pages = page_view(ts, s)[:2]
        q = ts.q.reshape(s.batch * s.q_len, s.num_q_heads, s.head_dim)
        run = self.wrapper.run
        return lambda: run(q, (k_pages, v_pages), **kw).view(s.batch, s.q_len, s.num_q_heads, s.head_dim)


class FlashInfer(Provider):
    name = "flashinfer"

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "needs CUDA"
        return _missing("flashinfer")

    def unsupported(self, case: Case) -> str | None:
        s = case.shape
        if not s.paged and case.base.k_cache.shape[1] % 16:
            return "contiguous capacity is not a multiple of the 16-key page"
        if s.head_dim not in (64, 128, 256):
            return f"head dim {s.head_dim}: its kernels are built for 64 / 128 / 256"
        if s.sinks or s.alibi:
            return "no per-head sink logits / ALiBi slopes of ours in its decode wrapper"
        return None

    def session(self, case: Case, graph: bool) -> Session:
        return _FlashInferSession(case, graph)


# ---------------------------------------------------------------- flash-attn
class _FlashAttnSession(Session):
    def __init__(self, fn, case: Case, table_kw: str):
        self.fn, self.causal, self.table_kw = fn, case.shape.causal, table_kw

    def bind(self, ts: TensorSet):
        fn, causal = self.fn, self.causal
        kw = {self.table_kw: ts.block_table} if ts.block_table is not None else {}
        return lambda: fn(ts.q, ts.k_cache, ts.v_cache, cache_seqlens=ts.cache_seqlens, causal=causal, **kw)


class FlashAttn(Provider):
    """flash_attn_with_kvcache: FA2 (`flash_attn`) or FA3 (`flash_attn_interface`, Hopper)."""

    def __init__(self, version: int):
        self.version = version
        self.module = "flash_attn" if version == 2 else "flash_attn_interface"
        self.name = f"flash-attn{version}"

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "needs CUDA"
        return _missing(self.module)

    def unsupported(self, case: Case) -> str | None:
        if case.shape.kv_dtype:
            return "no fp8 KV with bf16 q in flash_attn_with_kvcache"
        if not case.shape.plain:
            return "variants not passed to flash_attn_with_kvcache here"
        # FA2's paged path takes pages of a multiple of 256 keys only
        if self.version == 2 and case.shape.paged and case.shape.page_size % 256:
            return f"paged KV needs page_size % 256 == 0 (got {case.shape.page_size})"
        return None

    def session(self, case: Case, graph: bool) -> Session:
        mod = importlib.import_module(self.module)
        fn = mod.flash_attn_with_kvcache

        def call(*args, **kw):
            out = fn(*args, **kw)
            return out[0] if isinstance(out, tuple) else out

        # FA2 names the page table block_table, FA3 page_table
        return _FlashAttnSession(call, case, "block_table" if self.version == 2 else "page_table")


# ---------------------------------------------------------------- flex_attention
class _FlexSession(Session):
    def __init__(self, case: Case):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        s = case.shape
        self.fn = _compiled_flex(flex_attention)
        seqlens, Sq = case.base.cache_seqlens, s.q_len
        L = s.max_seqlen

        def mask_mod(b, h, q_idx, kv_idx):
            length = seqlens[b]
            return (kv_idx < length) & (kv_idx <= length - Sq + q_idx)

        self.block_mask = create_block_mask(mask_mod, s.batch, None, Sq, L, device=case.device)
        self.L, self._layout = L, {}
        self.note = "torch.compile'd, block mask from lengths"

    def bind(self, ts: TensorSet):
        L = self.L
        q = ts.q.transpose(1, 2).contiguous()
        k = ts.k_cache[:, :L].transpose(1, 2).contiguous()
        v = ts.v_cache[:, :L].transpose(1, 2).contiguous()
        self._layout[id(ts)] = (q, k, v)
        fn, bm = self.fn, self.block_mask
        return lambda: fn(q, k, v, block_mask=bm, enable_gqa=True).transpose(1, 2)

    def close(self) -> None:
        self._layout.clear()


_FLEX = {}


def _compiled_flex(flex_attention):
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


class Flex(Provider):
    """torch flex_attention (opt-in: PEERS.md measured <= 0.5 TB/s, and each shape recompiles)."""

    name = "flex"

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "needs CUDA (the compiled kernel is a Triton GPU kernel)"
        return _missing("torch.nn.attention.flex_attention")

    def unsupported(self, case: Case) -> str | None:
        if case.shape.kv_dtype or not case.shape.plain:
            return "no fp8 KV input / variants"
        return "no paged KV input" if case.shape.paged else None

    def session(self, case: Case, graph: bool) -> Session:
        if case.shape.head_dim not in (64, 128, 256):
            raise NotApplicable(f"head_dim {case.shape.head_dim}")
        return _FlexSession(case)
