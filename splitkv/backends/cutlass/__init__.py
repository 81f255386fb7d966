"""CuTe DSL backend (optional extra: `pip install 'splitkv[cutlass]'`, nvidia-cutlass-dsl==4.3.5).

    run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal)
    combine(o_part, lse_part, num_splits, out, lse, *, skip_single=False)

Same plan, workspace and semantics as the torch and Triton backends (see split_kernel.py and
combine_kernel.py). Importing this package never imports the DSL: `import splitkv` works without
it, and calling run/combine without it raises a RuntimeError saying how to install it.

Modules: config (pure-Python configs, tile rule, variant list), cache (compile cache), argpack
(fast host argument packing), launch (glue), split_kernel / combine_kernel (kernel classes), and
the device helpers layouts, paging, mainloop, softmax, epilogue.
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


def _launch():
    if not available():
        raise RuntimeError(INSTALL_HINT)
    from splitkv.backends.cutlass import launch

    return launch


def run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale, causal):
    _launch().run(q, k_cache, v_cache, cache_seqlens, block_table, plan, o_part, lse_part, out, lse, scale,
                  causal)


def combine(o_part, lse_part, num_splits, out, lse, *, skip_single=False):
    _launch().combine(o_part, lse_part, num_splits, out, lse, skip_single=skip_single)


__all__ = ["run", "combine", "available", "INSTALL_HINT"]
