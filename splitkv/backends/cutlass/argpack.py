"""Host argument packing for compiled CuTe DSL functions, without the DSL's per-call conversion.

The DSL's executor turns every scalar argument into a fresh DSL numeric and a fresh ctypes value
on each call (~10 us per argument in Python); a split launch has 43 arguments. A Packer owns one
ctypes slot per argument, writes the new values into them and hands the executor the same list
of pointers. It is checked against the DSL's own packing once, at construction; if the two
disagree (a DSL upgrade changed the calling convention), the Packer falls back to the DSL's path.

On top of that, each thread binds once per device: the executor (`compiled.to(device)`) and one
ctypes pointer array (our slots, the stream, the executor's result slot and kernel handles, in the
order the DSL's `_get_invoke_packed_args` builds per call). A launch then writes the slot values and
the stream pointer and calls the compiled host function with that array: no per-call list, array or
executor lookup (H200 profile, 2026-12-01: the DSL's packing was ~50 us of a 157 us eager call).

`bind(fixed, n_pointers)` is the floor, for a caller whose scalars are fixed (a plan and a call
layout): its own slots, with the scalars written once, the leading pointers and the stream in one
int64 array, so a launch is one slice assignment and the host function call. The caller holds the
plan's lock around it (threads on one stream share a plan, and so these slots: execute.py).
"""

import ctypes
import threading

import torch

_CTYPES = {"i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


def kinds_of(compiled) -> list[str]:
    """Slot kind per runtime argument, read off the compiled function's signature."""
    import cutlass

    names = {cutlass.Int64: "i64", cutlass.Int32: "i32", cutlass.Float32: "f32"}
    spec = compiled.args_spec.args_spec
    out = []
    for name in spec.args + spec.kwonlyargs:
        ann = spec.annotations.get(name)
        out.append(names.get(ann, "stream"))
    return out


class Packer:
    """launch(values..., stream): the scalars in signature order, then a cuda.CUstream."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.kinds = kinds_of(compiled)
        if self.kinds[-1] != "stream" or "stream" in self.kinds[:-1]:
            raise ValueError(f"unexpected signature {self.kinds}: scalars then one stream expected")
        self._local = threading.local()  # slots are per thread: two threads may launch at once
        self.fast = self._agrees()

    def _slots(self):
        slots = getattr(self._local, "slots", None)
        if slots is None:
            vals = [_CTYPES[k]() for k in self.kinds[:-1]]
            ptrs = [ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals]
            slots = self._local.slots = (vals, ptrs)
        return slots

    def _stream_ptrs(self, stream):
        if hasattr(stream, "__c_pointers__"):  # the order the DSL's own packing tries
            return stream.__c_pointers__(), stream
        from cutlass.base_dsl.jit_executor import JitArgAdapterRegistry
        from cutlass.base_dsl.typing import get_c_pointers

        adapter = JitArgAdapterRegistry.get_registered_adapter(type(stream))
        obj = adapter(stream) if adapter else stream
        return get_c_pointers(obj), obj

    def pack(self, values, stream):
        vals, ptrs = self._slots()
        for slot, v in zip(vals, values):
            slot.value = v
        sp, keep = self._stream_ptrs(stream)
        return list(ptrs) + sp, keep

    def _agrees(self) -> bool:
        """Our packing must point at the same bytes as the DSL's for a probe call."""
        import cuda.bindings.driver as cuda

        probe = [(-3 - i) * (1 << 33) if k == "i64" else (7 + i if k == "i32" else 0.5 + i)
                 for i, k in enumerate(self.kinds[:-1])]
        stream = cuda.CUstream(0)
        try:
            theirs, _ = self.compiled.generate_execution_args(*probe, stream)
            ours, _ = self.pack(probe, stream)
        except Exception:
            return False
        if len(theirs) != len(ours):
            return False
        for k, a, b in zip(self.kinds, theirs, ours):
            if k == "stream":
                continue
            ct = _CTYPES[k]
            pa = ctypes.cast(a, ctypes.POINTER(ct)).contents.value
            pb = ctypes.cast(b, ctypes.POINTER(ct)).contents.value
            if pa != pb:
                return False
        return True

    def _tail(self, ex) -> list[int]:
        """What the DSL's packing puts after the arguments: its result slot, the kernel handles."""
        tail = [ctypes.addressof(ex.cuda_result)] if ex.cuda_result is not None else []
        if ex.exec_context is not None:
            tail += [p.value if isinstance(p, ctypes.c_void_p) else p for p in ex.exec_context.kernel_functions_ptrs]
        return tail

    def bind(self, fixed: tuple, n_pointers: int):
        """launch(stream_handle, *pointers) for the current device: the first n_pointers (i64)
        arguments and the stream per call, `fixed` (the rest, in order) written once. None when the
        fast path is off or the stream is not one pointer-sized slot."""
        import cuda.bindings.driver as cuda

        kinds = self.kinds[:-1]
        if not self.fast or kinds[:n_pointers] != ["i64"] * n_pointers or len(fixed) != len(kinds) - n_pointers:
            return None
        if len(self._stream_ptrs(cuda.CUstream(0))[0]) != 1:
            return None
        ex = self.compiled.to(None)
        per_call = (ctypes.c_int64 * (n_pointers + 1))()  # the pointers, then the stream handle
        vals = [_CTYPES[k]() for k in kinds[n_pointers:]]
        for slot, v in zip(vals, fixed):
            slot.value = v
        addrs = [ctypes.addressof(per_call) + 8 * i for i in range(n_pointers)]
        addrs += [ctypes.addressof(v) for v in vals] + [ctypes.addressof(per_call) + 8 * n_pointers]
        addrs += self._tail(ex)
        arr = (ctypes.c_void_p * len(addrs))(*addrs)
        capi, result = ex.jit_module.capi_func, ex.cuda_result

        def launch(stream, *pointers):  # the caller holds the plan's lock (threads may share a plan)
            per_call[:] = (*pointers, stream)
            capi(arr)
            err = result.value if result is not None else 0
            if err != 0:
                raise RuntimeError(f"splitkv: CuTe DSL launch failed with CUDA error {err}")

        launch.keep = (ex, vals)  # arr points into vals; ex owns the module and the result slot
        return launch

    def _bound(self, stream):
        """(executor, pointer array, stream slot index) of this thread on the current device."""
        per_dev = getattr(self._local, "bound", None)
        if per_dev is None:
            per_dev = self._local.bound = {}
        dev = torch.cuda.current_device()
        b = per_dev.get(dev)
        if b is None:
            ex = self.compiled.to(None)  # None: the current device, as the DSL's own default executor
            vals, ptrs = self._slots()
            sp, _ = self._stream_ptrs(stream)
            tail = self._tail(ex)
            arr = (ctypes.c_void_p * (len(ptrs) + len(sp) + len(tail)))()
            for i, p in enumerate(ptrs):
                arr[i] = p.value
            for i, p in enumerate(tail):
                arr[len(ptrs) + len(sp) + i] = p
            b = per_dev[dev] = (ex, arr, len(ptrs), len(sp))
        return b

    def __call__(self, *args):
        if len(args) != len(self.kinds):
            raise TypeError(f"launch: {len(self.kinds)} arguments expected, got {len(args)}")
        if not self.fast:
            return self.compiled(*args)
        stream = args[-1]
        ex, arr, n, ns = self._bound(stream)
        vals, _ = self._slots()
        for slot, v in zip(vals, args[:-1]):
            slot.value = v
        sp, _keep = self._stream_ptrs(stream)
        if len(sp) != ns:  # another stream type than at binding: the DSL's own path
            exe_args, _keep = self.pack(args[:-1], stream)
            return self.compiled.run_compiled_program(exe_args)
        for i, p in enumerate(sp):
            arr[n + i] = p.value if isinstance(p, ctypes.c_void_p) else p
        ex.jit_module.capi_func(arr)
        if ex.cuda_result is not None and ex.cuda_result.value != 0:
            raise RuntimeError(f"splitkv: CuTe DSL launch failed with CUDA error {ex.cuda_result.value}")
