"""CuTe DSL backend (optional extra: `pip install 'splitkv[cutlass]'`, nvidia-cutlass-dsl==4.3.5).

    run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal)
    merge(o_part, lse_part, num_splits, out, lse, *, skip_single=False)

Same plan, workspace and semantics as the torch and Triton backends (see split_kernel.py and
merge_kernel.py). Importing this package never imports the DSL: `import splitkv` works without
it, and calling run/merge without it raises a RuntimeError saying how to install it.

Modules: config (pure-Python configs, tile rule, variant list), cache (compile cache), argpack
(fast host argument packing), launch (glue), split_kernel / merge_kernel (kernel classes), and
the device helpers layouts, paging, fp8 (fp8 caches), mainloop, score_mod (attention variants),
softmax, epilogue.
"""

import importlib.util
import os

INSTALL_HINT = ("backend 'cutlass' needs the CuTe DSL: pip install 'splitkv[cutlass]' "
                "(nvidia-cutlass-dsl==4.3.5) and a CUDA GPU (built for sm_90a; sm_80+ instructions)")


def available() -> bool:
    """The CuTe DSL is importable (checked without importing it: that takes seconds). A `cutlass`
    package without `cute` (e.g. the older nvidia-cutlass Python interface) does not count."""
    try:
        spec = importlib.util.find_spec("cutlass")
    except (ImportError, ValueError):  # e.g. sys.modules["cutlass"] = None (import blocked)
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(os.path.isdir(os.path.join(loc, "cute")) for loc in spec.submodule_search_locations)


def rows_aligned(t, align: int) -> bool:
    """Unit stride on the last dim and `align`-byte aligned rows (pointer and strides): what the
    kernels' vector accesses need (16 B for q / K / V / partials, 8 B for the output)."""
    esize = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % align == 0
            and all((s * esize) % align == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))


def layout_ok(q, k_cache, v_cache, out) -> bool:
    """backend='auto' takes cutlass only where its layout checks would pass."""
    return all(rows_aligned(t, 16) for t in (q, k_cache, v_cache)) and rows_aligned(out, 8)


def _launch():
    if not available():
        raise RuntimeError(INSTALL_HINT)
    from splitkv.backends.cutlass import launch

    return launch


def run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal,
        variant=None):
    _launch().run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale,
                  causal, None if variant is None or variant.plain else variant)


def bind(q, k_cache, v_cache, cache_seqlens, block_table, plan, out, lse, scale, causal, variant=None):
    return _launch().bind(q, k_cache, v_cache, cache_seqlens, block_table, plan, out, lse, scale, causal,
                          None if variant is None or variant.plain else variant)


def merge(o_part, lse_part, num_splits, out, lse, *, skip_single=False, sinks=None):
    _launch().merge(o_part, lse_part, num_splits, out, lse, skip_single=skip_single, sinks=sinks)


__all__ = ["run", "bind", "merge", "available", "layout_ok", "rows_aligned", "INSTALL_HINT"]
