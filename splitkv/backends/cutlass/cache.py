"""Compile cache of the CuTe DSL kernels: in memory, and on disk under SPLITKV_CACHE_DIR.

Key: kernel config name + target arch + a hash of this package's source files + the library
versions (nvidia-cutlass-dsl, cuda-bindings). Editing any kernel file or upgrading the DSL changes
the key, so a stale binary is never loaded. The disk entry is the compiled MLIR module (host launch
code + the embedded cubin) as bytecode plus a small JSON of what the DSL needs to rebuild its
executor; loading it skips tracing, the MLIR pipeline and ptxas. Loading needs a GPU (the host
JIT links the CUDA driver); any failure to load falls back to compiling, with one warning.

SPLITKV_CACHE_DIR=off disables the disk cache; default ~/.cache/splitkv/cutlass.
"""

import hashlib
import importlib.metadata
import json
import os
import tempfile
import threading
import warnings
from functools import lru_cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_LIBS = ("nvidia-cutlass-dsl", "cuda-bindings")


def cache_dir() -> Path | None:
    env = os.environ.get("SPLITKV_CACHE_DIR", "")
    if env.lower() in ("off", "0", "none"):
        return None
    return Path(env) if env else Path.home() / ".cache" / "splitkv" / "cutlass"


@lru_cache(maxsize=1)
def source_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(PACKAGE_DIR.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def library_versions() -> tuple[tuple[str, str], ...]:
    out = []
    for lib in _LIBS:
        try:
            out.append((lib, importlib.metadata.version(lib)))
        except importlib.metadata.PackageNotFoundError:
            out.append((lib, "absent"))
    return tuple(out)


def cache_key(name: str, arch: str) -> str:
    h = hashlib.sha256(f"{name}|{arch}|{source_hash()}|{library_versions()}".encode()).hexdigest()[:20]
    return f"{name}.{arch}.{h}"


def compile_options(arch: str, dump_dir: str | None = None) -> str:
    opts = f"--gpu-arch {arch}"
    if dump_dir is not None:
        opts += f" --keep-ptx --dump-dir {dump_dir}"
    return opts


def _save(key: str, compiled) -> None:
    root = cache_dir()
    if root is None:
        return
    try:
        import io

        root.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        compiled.ir_module.operation.write_bytecode(buf)
        meta = {"function_name": compiled.function_name,
                "kernel_info": {sym: {int(k): int(v) for k, v in attrs.items()}
                                for sym, attrs in compiled.kernel_info.items()}}
        for suffix, data in ((".json", json.dumps(meta).encode()), (".mlirbc", buf.getvalue())):
            fd, tmp = tempfile.mkstemp(dir=root)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, root / (key + suffix))  # atomic: readers never see half a file
    except Exception as e:  # a read-only or full disk must not break decoding
        warnings.warn(f"splitkv: could not write the cutlass kernel cache ({e})", stacklevel=3)


def _load(key: str, kernel_obj):
    """Rebuild a compiled function from the disk cache (GPU machines only), or None."""
    root = cache_dir()
    if root is None or not (root / (key + ".mlirbc")).exists():
        return None
    import inspect

    from cuda.bindings import driver
    from cutlass._mlir import ir
    from cutlass.cutlass_dsl import CuTeDSL
    from cutlass.cutlass_dsl.cuda_jit_executor import CudaDialectJitCompiledFunction

    meta = json.loads((root / (key + ".json")).read_text())
    attr = driver.CUfunction_attribute
    kernel_info = {sym: {attr(int(k)): v for k, v in attrs.items()} for sym, attrs in meta["kernel_info"].items()}
    dsl = CuTeDSL._get_dsl()
    with ir.Context():  # as the DSL's own file cache loads modules
        module = ir.Module.parse((root / (key + ".mlirbc")).read_bytes())
    engine = dsl.compiler_provider.jit(module, shared_libs=dsl.get_shared_libs())
    capi = engine.lookup(meta["function_name"])
    # the DSL builds the runtime signature from the undecorated __call__, as cute.compile does
    call = type(kernel_obj).__call__
    spec = inspect.getfullargspec(getattr(call, "__wrapped__", call))
    return CudaDialectJitCompiledFunction(module, engine, capi, spec, meta["function_name"], kernel_info,
                                          False, None)


class CompileCache:
    """(config name, arch) -> compiled function; builds at most once per key per process."""

    def __init__(self):
        self._mem: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self._warned = False
        self.stats = {"memory": 0, "disk": 0, "compiled": 0}  # where each get() was served from

    def get(self, name: str, arch: str, build):
        """build() -> (kernel object, fake compile args). Memory, then disk, then compile."""
        hit = self._mem.get((name, arch))
        if hit is not None:
            self.stats["memory"] += 1
            return hit
        with self._lock:
            hit = self._mem.get((name, arch))
            if hit is None:
                hit = self._compile_or_load(name, arch, build)
                self._mem[(name, arch)] = hit
        return hit

    def _compile_or_load(self, name, arch, build):
        import cutlass.cute as cute

        key = cache_key(name, arch)
        kernel_obj, fake_args = build()
        try:
            loaded = _load(key, kernel_obj)
            if loaded is not None:
                self.stats["disk"] += 1
                return loaded
        except Exception as e:
            if not self._warned:
                warnings.warn(f"splitkv: cutlass kernel cache entry {key} did not load ({e}); compiling",
                              stacklevel=4)
                self._warned = True
        compiled = cute.compile(kernel_obj, *fake_args, options=compile_options(arch))
        self.stats["compiled"] += 1
        _save(key, compiled)
        return compiled

    def clear(self):
        with self._lock:
            self._mem.clear()


CACHE = CompileCache()
