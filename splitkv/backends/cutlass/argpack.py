"""Host argument packing for compiled CuTe DSL functions, without the DSL's per-call conversion.

The DSL's executor turns every scalar argument into a fresh DSL numeric and a fresh ctypes value
on each call (~10 us per argument in Python); a split launch has 43 arguments. A Packer owns one
ctypes slot per argument, writes the new values into them and hands the executor the same list
of pointers. It is checked against the DSL's own packing once, at construction; if the two
disagree (a DSL upgrade changed the calling convention), the Packer falls back to the DSL's path.
"""

import ctypes
import threading

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

    def __call__(self, *args):
        if len(args) != len(self.kinds):
            raise TypeError(f"launch: {len(self.kinds)} arguments expected, got {len(args)}")
        if not self.fast:
            return self.compiled(*args)
        exe_args, _keep = self.pack(args[:-1], args[-1])
        return self.compiled.run_compiled_program(exe_args)
