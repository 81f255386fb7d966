"""splitkv: split-KV (flash-decoding) attention for long-context LLM decoding on PyTorch.

The package imports lazily (PEP 562): `import splitkv` loads no torch, so `python -m splitkv --help`
answers at once; `splitkv.decode`, `from splitkv import plan`, `splitkv.debug`, ... import their
module on first use. Any submodule is reachable as an attribute (`splitkv.heuristics`).

`plan` and `warmup` are both submodules and functions: the attribute is always the function, also
after `import splitkv.plan` (the submodule stays in sys.modules: `from splitkv.plan import build`).
"""

from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

# public name -> (submodule, attribute); attribute None: the submodule itself
_EXPORTS = {
    "decode": ("api", "decode"),
    "plan": ("plan", "plan"),
    "DecodePlan": ("plan", "DecodePlan"),
    "merge_states": ("merge", "merge_states"),
    "merge_states_n": ("merge", "merge_states_n"),
    "cascade_decode": ("cascade", "cascade_decode"),
    "group_prefix_decode": ("cascade", "group_prefix_decode"),
    "prefix_gather": ("cascade", "prefix_gather"),
    "PagedKVCache": ("cache", "PagedKVCache"),
    "CacheFullError": ("cache", "CacheFullError"),
    "clear_plans": ("execute", "clear_plans"),
    "RopeConfig": ("rope", "RopeConfig"),
    "apply_rope": ("rope", "apply_rope"),
    "reference": ("reference", None),
    "debug": ("debug", None),
    "warmup": ("warmup", "warmup"),
    "distributed": ("distributed", None),
}
# exported functions that share their submodule's name: the function wins over the submodule
_SHADOWED = {name for name, (mod, attr) in _EXPORTS.items() if mod == name and attr == name}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        mod, attr = _EXPORTS[name]
        module = importlib.import_module(f"{__name__}.{mod}")
        value = module if attr is None else getattr(module, attr)
    elif not name.startswith("__"):
        try:  # any other submodule, as an eager package would have it after its imports
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists but something it imports does not
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The import system binds a loaded submodule as an attribute of its package; for `plan` and
    `warmup` bind the function of that name instead (what the eager package exported)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
