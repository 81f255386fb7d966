"""Launch compiled Triton kernels without the JIT's per-call argument binding.

Why: measured on the H200 host (2026-11-29; `python -m splitkv bench --host-breakdown` measures it
today), `kernel[grid](...)` with our ~45 arguments cost ~56 us of CPU per launch — several times
the GPU time of a small decode.
The first call of each specialisation goes through the normal JIT (compile + launch) and returns
the CompiledKernel; later calls with the same key call its launcher directly.

The key holds what Triton specialises on: constexprs, launch options, every int argument's value
(strides: stable for a given shape) and whether all pointers are 16-byte aligned (otherwise we
take the JIT path every time, which is always correct).

`direct()` is the floor: Triton's C launch function itself, called with every pointer as an int
(an int skips the launcher's per-pointer `data_ptr()` call and its `cuPointerGetAttribute` driver
query, ~12 per split launch) and everything else bound once. It exists only for kernels that need
no global or profile scratch (ours), where the Python `CudaLauncher.__call__` adds nothing.

Below the C launch function: `driver_launch()` builds the kernel's parameter array once (the
pointers in one int64 array written per call, every scalar in its own ctypes slot written once,
the two scratch pointers Triton appends as NULL) and calls the driver's cuLaunchKernel through
ctypes, skipping the launcher's per-call parse of ~60 Python arguments. It reads the parameter
types off the compiled signature (`kernel.src.signature`, what Triton's launcher is generated
from: constexprs, ints specialised to 1 included, are not parameters) and declines (None: direct()
as before) for anything it does not model: another parameter type, clusters, cooperative or PDL
launches, scratch memory. Off unless SPLITKV_TRITON_DRIVER_LAUNCH=1 (read at import): its packing is
CPU-tested against a recorded driver call, but it has not yet run on a GPU (to do: the GPU tests and
`python -m splitkv bench --host-breakdown` with the variable at 0 and at 1, in one call).

`Bound` goes one step further for a caller that can name its own key cheaply (a plan: its shapes
and workspace are fixed, so the strides of the call's tensors and their alignment are the key):
it keeps (kernel, scalars, constexpr values) per key and a hit only launches.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

DRIVER_LAUNCH = os.environ.get("SPLITKV_TRITON_DRIVER_LAUNCH", "0") not in ("", "0")

# parameter types of a compiled signature -> ctypes (Triton's ty_to_cpp; floats as their storage)
_SCALARS = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
            "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
            "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "f32": ctypes.c_float,
            "fp64": ctypes.c_double}


def launch_compiled(kernel, grid, tensors: tuple, values: tuple) -> None:
    stream = torch._C._cuda_getCurrentRawStream(tensors[0].device.index)  # ~0.1 us; current_stream() ~3
    kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, kernel.function, kernel.packed_metadata,
               None, None, None, *tensors, *values)


class FastLauncher:
    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}

    def __call__(self, grid, tensors: tuple, scalars: tuple, constexprs: dict, num_warps: int,
                 num_stages: int):
        """Launch fn(*tensors, *scalars, **constexprs); constexprs must be the trailing parameters
        of fn in signature order. Returns the compiled kernel (None under TRITON_INTERPRET)."""
        aligned = all((t.data_ptr() & 15) == 0 for t in tensors)
        key = ((tuple(constexprs.values()), num_warps, num_stages, tuple(t.dtype for t in tensors), scalars)
               if aligned else None)
        kernel = self.cache.get(key) if key is not None else None
        if kernel is None:
            kernel = self.fn[grid](*tensors, *scalars, **constexprs, num_warps=num_warps, num_stages=num_stages)
            if key is not None and kernel is not None:  # None under TRITON_INTERPRET
                self.cache[key] = kernel
            return kernel
        launch_compiled(kernel, grid, tensors, (*scalars, *constexprs.values()))
        return kernel


class Bound:
    """Per-owner launch cache: key -> (kernel, argument values after the tensors, direct launch).
    An owner (a plan) launches each kernel with one grid, so a hit launches through direct()."""

    def __init__(self):
        self.entries: dict = {}

    def launch(self, key, grid, tensors: tuple, aligned: bool, build) -> None:
        """build() -> (FastLauncher, scalars, constexprs, num_warps, num_stages), called on a miss."""
        hit = self.entries.get(key) if aligned else None
        if hit is not None:
            if hit[2] is not None:
                hit[2](torch._C._cuda_getCurrentRawStream(tensors[0].device.index), *[t.data_ptr() for t in tensors])
            else:
                launch_compiled(hit[0], grid, tensors, hit[1])
            return
        fl, scalars, cx, warps, stages = build()
        kernel = fl(grid, tensors, scalars, cx, warps, stages)
        if aligned and kernel is not None:
            tail = (*scalars, *cx.values())
            self.entries[key] = (kernel, tail, direct(kernel, grid, tail))


def direct(kernel, grid, tail: tuple):
    """launch(stream, *pointers): kernel's C launch function with the grid, the handle, the
    metadata and the trailing (non-pointer) arguments bound. None when the kernel needs what only
    Triton's Python launcher provides (global / profile scratch, tensor descriptors) or this
    Triton's launcher is not the C function this binds to."""
    runner = kernel.run
    c = getattr(runner, "launch", None)
    if (c is None or getattr(c, "__name__", "") != "launch" or getattr(runner, "global_scratch_size", 1)
            or getattr(runner, "profile_scratch_size", 1)):
        return None
    gx, gy = grid[0], grid[1] if len(grid) > 1 else 1
    fast = driver_launch(kernel, gx, gy, tail)
    if fast is not None:
        return fast
    fn, meta = kernel.function, kernel.packed_metadata
    coop, pdl = runner.launch_cooperative_grid, runner.launch_pdl

    def launch(stream, *pointers):
        c(gx, gy, 1, stream, fn, coop, pdl, None, None, meta, None, None, None, *pointers, *tail)

    return launch


@functools.lru_cache(maxsize=None)
def _cu_launch_kernel():
    """libcuda's cuLaunchKernel through ctypes (None where the driver library is absent)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    f = lib.cuLaunchKernel
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    f.restype = ctypes.c_int
    return f


def param_slots(types: list, tail: tuple):
    """(pointer array, parameter array, kept slots) for a kernel whose launcher signature is `types`
    (in order; the leading '*' types take the per-call pointers, the rest take `tail` in order,
    "constexpr" ones being no parameter), or None for a type this does not model. The parameter
    array ends with the two scratch pointers Triton appends (NULL: kernels without scratch)."""
    n_ptr = 0
    while n_ptr < len(types) and str(types[n_ptr]).startswith("*"):
        n_ptr += 1
    rest = types[n_ptr:]
    if len(rest) != len(tail):
        return None
    pointers = (ctypes.c_uint64 * (n_ptr + 2))()  # the call's pointers, then the two scratch NULLs
    addrs = [ctypes.addressof(pointers) + 8 * i for i in range(n_ptr)]
    kept = []
    for ty, value in zip(rest, tail):
        if ty == "constexpr":
            continue
        ct = _SCALARS.get(ty) if isinstance(ty, str) else None
        if ct is None:
            return None
        slot = ct(value)
        kept.append(slot)
        addrs.append(ctypes.addressof(slot))
    addrs += [ctypes.addressof(pointers) + 8 * n_ptr, ctypes.addressof(pointers) + 8 * (n_ptr + 1)]
    return pointers, (ctypes.c_void_p * len(addrs))(*addrs), kept, n_ptr


def driver_launch(kernel, gx: int, gy: int, tail: tuple):
    """launch(stream, *pointers) through cuLaunchKernel with the parameter array built once (module
    docstring), or None where this does not model the kernel's launch."""
    runner, meta = kernel.run, kernel.metadata
    sig = getattr(getattr(kernel, "src", None), "signature", None)
    cu = _cu_launch_kernel() if DRIVER_LAUNCH else None
    if (cu is None or not isinstance(sig, dict) or getattr(meta, "num_ctas", 1) != 1
            or getattr(runner, "launch_cooperative_grid", True) or getattr(runner, "launch_pdl", True)):
        return None
    slots = param_slots(list(sig.values()), tail)
    if slots is None:
        return None
    pointers, params, kept, n_ptr = slots
    fn, threads, smem = kernel.function, 32 * meta.num_warps, meta.shared

    if gx * gy == 0:  # Triton's launcher skips an empty grid; cuLaunchKernel would reject it
        def launch(stream, *ptrs):
            return None

        launch.keep = (pointers, kept)
        return launch

    def launch(stream, *ptrs):
        pointers[:n_ptr] = ptrs
        err = cu(fn, gx, gy, 1, threads, 1, 1, smem, stream, params, None)
        if err:
            raise RuntimeError(f"splitkv: cuLaunchKernel failed with CUDA error {err}")

    launch.keep = (pointers, kept)  # params points into these
    return launch
