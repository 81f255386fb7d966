"""Backend registry. A backend module exposes
    run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
        variant)   (variant: splitkv.variants.Variant, PLAIN by default)
    merge(o_part, lse_part, num_splits, out, lse)
and decides nothing: the plan (splitkv/plan.py) names the backend, its tile, the split table and
whether the merge is fused; `resolve` and `auto_cutlass_here` are what the plan asks, once."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

_MODULES = {
    "torch": "splitkv.backends.torch_backend",
    "triton": "splitkv.backends.triton",
    "cutlass": "splitkv.backends.cutlass",
}


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def cutlass_available() -> bool:
    """The CuTe DSL is importable (checked without importing it); SPLITKV_DISABLE_CUTLASS=1 turns
    the backend off."""
    if os.environ.get("SPLITKV_DISABLE_CUTLASS", "0") not in ("", "0"):
        return False
    from .cutlass import available

    return available()


def resolve(backend: str, device: torch.device) -> str:
    """'auto' -> the best backend for the device; SPLITKV_BACKEND overrides 'auto'."""
    if backend == "auto":
        backend = os.environ.get("SPLITKV_BACKEND", "auto") or "auto"
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        return "triton" if triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend: 'triton' requested but triton is not installed (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"backend: 'triton' needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 "
                             "before importing triton to run it on the CPU")
    if backend == "cutlass" and not cutlass_available():
        raise RuntimeError("backend: 'cutlass' is not available here; it needs an sm90 GPU and "
                           "`pip install splitkv[cutlass]` (nvidia-cutlass-dsl==4.3.5)")
    if backend == "torch" or backend in _MODULES:
        return backend
    raise ValueError(f"backend: expected one of 'auto', {tuple(_MODULES)}, got {backend!r}")


def auto_cutlass_here(device) -> bool:
    """'auto' may run cutlass on this device: the rule is on, no SPLITKV_BACKEND override, the CuTe
    DSL is installed and the GPU is sm90. Asked once per plan, never per call."""
    from .. import heuristics as H

    if not H.AUTO_CUTLASS or os.environ.get("SPLITKV_BACKEND", "auto") not in ("", "auto"):
        return False
    return device.type == "cuda" and cutlass_available() and torch.cuda.get_device_capability(device)[0] == 9


def get(backend: str):
    return importlib.import_module(_MODULES[backend])
