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
Below it, cuLaunchKernel through ctypes with a parameter array built once measured slower on an
H100 host (2026-12-07, `bench --host-breakdown`, a plan's bound split + merge launches: 14.5 us
through this C function, 19.3 through ctypes; the ctypes call and the pointer writes cost more than
the launcher's argument parse; benchmarks/NOTES.md #79).

`Bound` goes one step further for a caller that can name its own key cheaply (a plan: its shapes
and workspace are fixed, so the strides of the call's tensors and their alignment are the key):
it keeps (kernel, scalars, constexpr values) per key and a hit only launches.
"""

from __future__ import annotations

import torch


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
    fn, meta = kernel.function, kernel.packed_metadata
    coop, pdl = runner.launch_cooperative_grid, runner.launch_pdl

    def launch(stream, *pointers):
        c(gx, gy, 1, stream, fn, coop, pdl, None, None, meta, None, None, None, *pointers, *tail)

    return launch
