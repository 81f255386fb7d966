"""Which providers a run uses: names, groups and the default selection."""

from __future__ import annotations

import torch

from .external import FlashAttn, FlashInfer, Flex
from .providers import NOPLAN, SDPA, Provider, SplitKV

SPLITKV_BACKENDS = ("triton", "cutlass", "torch", "auto")  # auto: what decode(backend="auto") runs
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flashinfer", "flash-attn2", "flash-attn3")
OPT_IN = ("flex",)  # not in the default set: PEERS.md measured it at <= 0.5 TB/s, and it recompiles per shape


def default_backends(device: torch.device) -> tuple[str, ...]:
    # the torch backend on a GPU is the readable spec, not a contender (and not graph-capturable)
    return ("triton", "cutlass") if device.type == "cuda" else ("torch",)


def splitkv_names(backend: str) -> list[str]:
    """The two calling modes of one backend: plan reused (eager + graph) and no plan (eager)."""
    return [f"splitkv-{backend}", f"splitkv-{backend}{NOPLAN}"]


def make(name: str, num_splits: int | None = None) -> Provider:
    if name.startswith("splitkv-"):
        backend = name[len("splitkv-"):]
        noplan = backend.endswith(NOPLAN)
        if noplan:
            backend = backend[:-len(NOPLAN)]
        if backend not in SPLITKV_BACKENDS:
            raise ValueError(f"providers: unknown splitkv backend in {name!r}, "
                             f"expected splitkv-<backend>[{NOPLAN}] with a backend of {SPLITKV_BACKENDS}")
        return SplitKV(backend, num_splits, noplan=noplan)
    if name.startswith("sdpa-") and name[5:] in ("flash", "cudnn", "efficient"):
        return SDPA(name[5:])
    if name == "flashinfer":
        return FlashInfer()
    if name in ("flash-attn2", "flash-attn3"):
        return FlashAttn(int(name[-1]))
    if name == "flex":
        return Flex()
    raise ValueError(f"providers: unknown provider {name!r}; expected splitkv-<backend>[{NOPLAN}], one of "
                     f"{PEERS + OPT_IN}, or a group: splitkv, peers, all")


def expand(spec: str | None, backends: tuple[str, ...]) -> list[str]:
    """'splitkv,peers' (default) -> provider names; groups: splitkv (every backend in both calling
    modes: splitkv-<b> and splitkv-<b>-noplan), peers, all."""
    out: list[str] = []
    ours = [n for b in backends for n in splitkv_names(b)]
    for tok in (spec or "splitkv,peers").split(","):
        tok = tok.strip()
        if tok == "splitkv":
            names = ours
        elif tok == "peers":
            names = list(PEERS)
        elif tok == "all":
            names = ours + list(PEERS) + list(OPT_IN)
        elif tok:
            names = [tok]
        else:
            names = []
        out += [n for n in names if n not in out]
    return out


def select(spec: str | None, backends: tuple[str, ...], num_splits: int | None = None):
    """(usable providers, [(name, reason)] skipped because they cannot run on this machine)."""
    chosen, skipped = [], []
    for name in expand(spec, backends):
        p = make(name, num_splits)
        reason = p.unavailable()
        if reason is None:
            chosen.append(p)
        else:
            skipped.append((name, reason))
    return chosen, skipped
