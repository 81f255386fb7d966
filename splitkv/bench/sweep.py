"""`--num-splits sweep` and `--sweep-tiles`: the planner's report card.

For each shape, time splitkv with every forced num_splits in a range (plans that come out
identical — same grid and per-request split counts — are timed once) and with the planner's own
plan (each sized for the swept backend and cache layout); report
the planner's pick, the best measured, and the regret = planner time / best forced time - 1 (%).
Negative regret means the planner's plan beat every forced count. Graph mode (CUDA) times
graph-safe plans under CUDA-graph replay, as a server would run them; eager mode times eager plans
with the L2 flushed. Timing only: correctness is the main table's and the tests' job.

`--sweep-tiles` does the same over kernel tiles (block_n x num_warps x num_stages, forced through
heuristics.tile_override while the plan is built; the split rule sizes its chunks with the forced
block_n) at the planner's split rule: the evidence behind heuristics.tile_config / cutlass_tile.
"""

from __future__ import annotations

import splitkv
from splitkv import heuristics as H

from .inputs import build_case
from .runner import DTYPES, Config
from .timing import time_eager, time_graph


def parse_range(text: str) -> range:
    """'1:64' -> 1..64 inclusive; '8' -> 1..8."""
    try:
        lo, hi = (int(x) for x in text.split(":")) if ":" in text else (1, int(text))
    except ValueError:
        raise ValueError(f"--sweep-range: expected LO:HI (e.g. 1:64), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--sweep-range: expected 1 <= LO <= HI, got {text!r}")
    return range(lo, hi + 1)


# Tiles swept when --sweep-tiles names none (BNxWxS). The cutlass kernel always runs 4 warps.
DEFAULT_TILES = {"triton": "64x4x3,64x4x4,128x4x3,128x8x3,32x4x4,64x8x3", "cutlass": "64x4x3,128x4x3,128x4x2"}


def parse_tiles(text: str, backend: str) -> list[tuple[int, int, int, bool | None]]:
    """'64x4x3,128x4x2:fused' -> [(64, 4, 3, None), (128, 4, 2, True)]; ':fused' / ':merge' force the
    split kernel's own merge or the merge kernel; 'default' -> the backend's DEFAULT_TILES."""
    text = DEFAULT_TILES.get(backend, DEFAULT_TILES["triton"]) if text == "default" else text
    tiles = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        body, _, merge = item.lower().partition(":")
        if merge not in ("", "fused", "merge"):
            raise ValueError(f"--sweep-tiles: the suffix of {item!r} must be :fused or :merge")
        try:
            bn, w, st = (int(x) for x in body.split("x"))
        except ValueError:
            raise ValueError(f"--sweep-tiles: expected BLOCK_NxWARPSxSTAGES items (e.g. 64x4x3), got {item!r}") from None
        if min(bn, w, st) < 1:
            raise ValueError(f"--sweep-tiles: every field must be >= 1, got {item!r}")
        tiles.append((bn, w, st, {"": None, "fused": True, "merge": False}[merge]))
    if not tiles:
        raise ValueError(f"--sweep-tiles: no tile in {text!r}")
    return tiles


def _splits(p) -> list[int]:
    """Per-request split counts of a plan (read from the device, outside any timed region)."""
    return [int(n) for n in p.num_splits.tolist()]


def _effective_splits(p) -> int:
    """Splits of the request that has the most (a forced count may exceed what a short request fills)."""
    return min(p.max_splits, max(_splits(p), default=1))


class _Timer:
    """Times plans of one shape on rotating input sets (graph) or the base set (eager)."""

    def __init__(self, shape, backend: str, cfg: Config, dtype: str):
        self.case = build_case(shape, DTYPES[dtype], cfg.device, cfg.seed)
        self.graph = cfg.graph and cfg.device.type == "cuda" and backend != "torch"
        self.sets = self.case.rotation(self.case.rotation_count()) if self.graph else [self.case.base]
        self.bound = shape.max_seqlen if self.graph else None
        self.shape, self.backend, self.cfg = shape, backend, cfg

    def plan(self, n=None):
        s = self.shape
        p = splitkv.plan(self.case.base.cache_seqlens, s.num_q_heads, s.num_kv_heads, s.head_dim, q_len=s.q_len,
                         num_splits=n, max_seqlen=self.bound, backend=self.backend, paged=s.paged,
                         kv_dtype=self.case.base.k_cache.dtype, **self.case.call_kwargs)
        if self.bound is not None:
            p.refresh(self.case.base.cache_seqlens)  # once per step, before the replays
        return p

    def time(self, p) -> float:
        s, backend = self.shape, self.backend
        fns = [lambda ts=ts: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens,
                                            block_table=ts.block_table, causal=s.causal, plan=p, backend=backend,
                                            **self.case.call_kwargs)
               for ts in self.sets]
        if self.graph:
            return time_graph(fns, self.cfg.device, self.cfg.reps)[0]
        return time_eager(fns[0], self.cfg.device, self.cfg.reps, self.cfg.flush)[0]

    def cmd(self, flag: str) -> str:
        return (f"python -m splitkv bench --suite {self.cfg.suite} --shapes {self.shape.name} "
                f"--providers splitkv-{self.backend} {flag}"
                + (" --device cpu" if self.cfg.device.type == "cpu" else "")
                + ("" if self.cfg.graph else " --no-graph")
                + ("" if self.cfg.flush == "write" else f" --flush {self.cfg.flush}"))


def sweep_shape(shape, backend: str, cfg: Config, splits: range, dtype: str = "bf16", on_step=None) -> dict:
    t = _Timer(shape, backend, cfg, dtype)
    planner = t.plan(None)
    first_us = t.time(planner)
    curve, seen = [], set()
    for n in splits:
        p = t.plan(n)
        key = (p.max_splits, tuple(_splits(p)))
        if key not in seen:
            seen.add(key)
            curve.append({"num_splits": n, "splits": _effective_splits(p), "us": t.time(p)})
        if on_step:
            on_step(shape.name, n)
    planner_us = min(first_us, t.time(planner))  # again last: see runner.GRAPH_CAPTURES (slow first captures)
    best = min(curve, key=lambda c: c["us"])
    t.case.release()
    return {
        "shape": shape.name, "mode": "graph" if t.graph else "eager", "backend": backend, "dtype": dtype,
        "planner_splits": _effective_splits(planner), "planner_us": planner_us,
        "planner_plan": planner.describe(), "best_splits": best["splits"],
        "best_num_splits": best["num_splits"],
        "best_us": best["us"], "regret_pct": 100.0 * (planner_us / best["us"] - 1.0), "curve": curve,
        "cmd": t.cmd(f"--num-splits sweep --sweep-range {splits.start}:{splits.stop - 1}"),
    }


def _tile_name(block_n: int, warps: int, stages: int, fuse: bool | None) -> str:
    """The --sweep-tiles spelling: BNxWxS, with :fused / :merge when the merge choice is given."""
    return f"{block_n}x{warps}x{stages}" + ("" if fuse is None else (":fused" if fuse else ":merge"))


def _plan_tile(p) -> str:
    """What a plan launches, in that spelling (the merge choice only when it splits)."""
    return _tile_name(p.tile.block_n, p.tile.num_warps, p.tile.num_stages, p.fuse if p.max_splits > 1 else None)


def sweep_tiles(shape, backend: str, cfg: Config, tiles: list, dtype: str = "bf16", on_step=None) -> dict:
    """The planner's tile vs each forced tile, at the planner's split rule (a plan per tile)."""
    t = _Timer(shape, backend, cfg, dtype)
    planner = t.plan(None)
    first_us = t.time(planner)
    curve = []
    for bn, w, st, fuse in tiles:
        name = _tile_name(bn, w, st, fuse)
        try:
            with H.tile_override(block_n=bn, num_warps=w, num_stages=st, fused_merge=fuse):
                p = t.plan(None)
            curve.append({"tile": name, "launched": _plan_tile(p),
                          "splits": _effective_splits(p), "us": t.time(p)})
        except Exception as exc:  # a tile the kernel rejects (shared memory, registers): reported, not fatal
            curve.append({"tile": name, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"})
        if on_step:
            on_step(shape.name, f"tile {name}")
    planner_us = min(first_us, t.time(planner))  # again last, as in sweep_shape
    timed = [c for c in curve if "us" in c]
    best = min(timed, key=lambda c: c["us"]) if timed else {"tile": None, "us": float("nan")}
    t.case.release()
    spec = ",".join(c["tile"] for c in curve)
    return {
        "shape": shape.name, "mode": "graph" if t.graph else "eager", "backend": backend, "dtype": dtype,
        "sweep": "tiles", "planner_tile": _plan_tile(planner),
        "planner_us": planner_us,
        "planner_plan": planner.describe(), "best_tile": best["tile"], "best_us": best["us"],
        "regret_pct": 100.0 * (planner_us / best["us"] - 1.0), "curve": curve,
        "cmd": t.cmd(f"--sweep-tiles {spec} --sweep-only"),
    }


def run_sweep(shapes, backend: str, cfg: Config, splits: range, on_step=None) -> list[dict]:
    return [sweep_shape(s, backend, cfg, splits, cfg.dtypes[0], on_step) for s in shapes]


def run_tile_sweep(shapes, backend: str, cfg: Config, tiles: list, on_step=None) -> list[dict]:
    return [sweep_tiles(s, backend, cfg, tiles, cfg.dtypes[0], on_step) for s in shapes]
