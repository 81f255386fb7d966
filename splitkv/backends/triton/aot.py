"""Ahead-of-time compile of the Triton kernels for a GPU target on a machine without one.

Catches compile errors (and reports registers/spills) on the CPU: `python -m splitkv.backends.triton.aot`
compiles every split/merge variant the planner can pick, for sm_90. Must run without
TRITON_INTERPRET (the interpreter replaces @triton.jit functions with Python ones).
"""

from __future__ import annotations

import itertools
import sys

from ... import heuristics as H


def _compile(fn, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    # what the JIT specialises at run time for real inputs: pointers and strides divisible by 16
    # (without it no 16-byte vector loads, so the resource report would not match what runs)
    div16 = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
             for k, t in signature.items() if t.startswith("*") or (t == "i32" and k.startswith("s_"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=div16)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def find_ptxas(arch: int = 90) -> str | None:
    """The ptxas the installed Triton itself compiles for `arch` with (its own lookup: the
    TRITON_PTXAS*_PATH variables, then the ptxas it bundles), or None when it finds none that runs.

    Which binary that is depends on the version: Triton 3.9 compiles sm_90 with its bundled
    `ptxas-blackwell` (the plain `ptxas` it still ships is CUDA 12.8 and rejects the PTX 9.x it emits),
    3.3 and 3.6-3.8 pick by arch, 3.4-3.5 have one. API: 3.0-3.2 `_path_to_binary("ptxas")` and 3.3
    `get_ptxas(arch)` return (path, version); 3.4-3.5 `get_ptxas()` and 3.6+ `get_ptxas(arch)` a tool
    with `.path`. Tested with 3.6 and 3.9.
    """
    import inspect
    import os

    try:
        from triton.backends.nvidia import compiler as nv
    except Exception:
        return None
    try:
        get = getattr(nv, "get_ptxas", None)
        if get is None:
            tool = nv._path_to_binary("ptxas")
        else:
            try:
                takes_arch = bool(inspect.signature(get).parameters)
            except (TypeError, ValueError):
                takes_arch = True
            tool = get(arch) if takes_arch else get()
    except Exception:  # Triton raises RuntimeError("Cannot find ptxas") when no candidate runs
        return None
    path = getattr(tool, "path", None) or (tool[0] if isinstance(tool, (tuple, list)) else tool)
    return path if isinstance(path, str) and os.path.isfile(path) else None


def _resources(kernel, arch: int) -> dict:
    """Registers / spill bytes from `ptxas -v` on the kernel's PTX, with the ptxas Triton uses for `arch`."""
    import os
    import re
    import subprocess
    import tempfile

    ptxas = find_ptxas(arch)
    if ptxas is None:
        raise RuntimeError(f"no usable ptxas for sm_{arch}: the installed Triton finds none "
                           "(see TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH)")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        res = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{ptxas} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    return dict(regs=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else 0,
                smem=kernel.metadata.shared)


NO_VARIANT = dict(SOFTCAP=False, ALIBI=False, WINDOW=False, SINKS=False, KV_FP8=False, SCALE_PER_HEAD=False)
ALL_VARIANTS = dict(SOFTCAP=True, ALIBI=True, WINDOW=True, SINKS=True, KV_FP8=False, SCALE_PER_HEAD=False)
FP8_PER_HEAD = dict(NO_VARIANT, KV_FP8=True, SCALE_PER_HEAD=True)


def split_variants():
    """(constexprs, tile) for every head dim x packed-row class x paging x causal the plan can pick,
    plain; then padded head dims (80, 96, 192) and every attention variant at once."""
    for D, rows, paged, causal, splitting in itertools.product((64, 128, 256), (1, 4, 32, 256), (False, True),
                                                               (False, True), (True, False)):
        if (causal and rows == 1) or (not splitting and (D == 256 or causal)):
            continue  # Sq = 1 has no causal mask; the unsplit tile differs only for D <= 128
        yield _split_constexprs(D, rows, paged, causal, splitting, NO_VARIANT)
    for D, paged, var in itertools.product((80, 96, 128, 192), (False, True), (NO_VARIANT, ALL_VARIANTS)):
        if D != 128 or var is ALL_VARIANTS:
            yield _split_constexprs(D, 4, paged, False, True, var)
    for D, paged, splitting in itertools.product((64, 128), (False, True), (True, False)):
        yield _split_constexprs(D, 4, paged, False, splitting, FP8_PER_HEAD)
    for D in (64, 128):  # the launch.HOIST_ROWS probe (contiguous fp8 only)
        cx, tile = _split_constexprs(D, 4, False, False, True, FP8_PER_HEAD)
        yield dict(cx, HOIST_ROWS=True), tile
    for D, rows, paged in itertools.product((64, 128), (1, 4, 32), (False, True)):  # split grids on the
        yield _split_constexprs(D, rows, paged, False, True, NO_VARIANT, whole=True)  # unsplit tile


def _split_constexprs(D, rows, paged, causal, splitting, var, whole=False):
    """whole: a split plan whose CTAs stream whole sequences (heuristics.streams_whole_sequences):
    the unsplit tile with the split kernel's work list and fused merge."""
    tile = H.tile_config(D, rows, splitting and not whole, kv_fp8=var["KV_FP8"])
    G, SQ = (rows, 1) if rows <= 16 else (16, rows // 16)
    return dict(NUM_KV_HEADS=8, M_TILES=H.query_tiles(rows, tile.block_m), G=G, SQ=SQ, HEAD_DIM=D,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, PAGE_SIZE=16 if paged else 1, PAGED=paged,
                PAGE_ALIGNED=paged and not var["WINDOW"],
                CAUSAL=causal, UPCAST=False, FUSED_MERGE=splitting, BLOCK_D=1 << (D - 1).bit_length(),
                **var, HAS_WORK=splitting, V_PAIRS=var["KV_FP8"], E5M2=False, HOIST_ROWS=False), tile


def _compile_split(cx: dict, tile, arch: int, dtype: str = "bf16"):
    from .split_kernel import split_kernel

    ptr, f32 = f"*{dtype}", "*fp32"
    sig = {n: "i32" for n in split_kernel.arg_names if n not in cx}
    sig.update(Q=ptr, K=ptr, V=ptr, SEQLENS="*i32", NSPLITS="*i32", CHUNKS="*i32", WORK="*i32", BT="*i32",
               O_PART=f32, LSE_PART=f32, O=ptr, LSE=f32, COUNTERS="*i32", SINKS_PTR=f32, ALIBI_PTR=f32,
               KS_PTR=f32, VS_PTR=f32, qk_mul="fp32", cap_mul="fp32", v_mul="fp32")
    if cx["KV_FP8"]:
        sig.update(K="*fp8e4nv", V="*fp8e4nv")
    return _compile(split_kernel, sig, cx, arch, tile.num_warps, H.launch_stages(tile, cx["PAGED"]))


def compile_all(arch: int = 90, dtype: str = "bf16", verbose: bool = True) -> list[dict]:
    from .merge_kernel import merge_kernel

    ptr, f32 = f"*{dtype}", "*fp32"
    rows = []
    for cx, tile in split_variants():
        k = _compile_split(cx, tile, arch, dtype)
        rows.append(dict(kernel="split", **{k_: v for k_, v in cx.items() if k_ not in ("UPCAST",)},
                         **_resources(k, arch)))
    for D, sinks in ((64, False), (128, False), (256, False), (80, True), (192, True)):
        cx = dict(NUM_HEADS=32, T=1, HEAD_DIM=D, BLOCK_S=16, SKIP_SINGLE=True, BLOCK_D=1 << (D - 1).bit_length(),
                  SINKS=sinks)
        sig = {n: "i32" for n in merge_kernel.arg_names if n not in cx}
        sig.update(O_PART=f32, LSE_PART=f32, NSPLITS="*i32", O=ptr, LSE=f32, SINKS_PTR=f32)
        k = _compile(merge_kernel, sig, cx, arch, 4, 1)
        rows.append(dict(kernel="merge", HEAD_DIM=D, SINKS=sinks, **_resources(k, arch)))
    if verbose:
        for r in rows:
            print(r)
    return rows


if __name__ == "__main__":
    sys.exit(0 if compile_all(arch=int(sys.argv[1]) if len(sys.argv) > 1 else 90) else 1)
