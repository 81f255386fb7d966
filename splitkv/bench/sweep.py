"""`--num-splits sweep`: the planner's report card.

For each shape, time splitkv with every forced num_splits in a range (plans that come out
identical — same grid and per-request split counts — are timed once) and with the planner's own
plan (each sized for the swept backend and cache layout); report
the planner's pick, the best measured, and the regret = planner time / best forced time - 1 (%).
Negative regret means the planner's plan beat every forced count. Graph mode (CUDA) times
graph-safe plans under CUDA-graph replay, as a server would run them; eager mode times eager plans
with the L2 flushed. Timing only: correctness is the main table's and the tests' job.
"""

from __future__ import annotations

import splitkv

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


def _splits(p) -> list[int]:
    """Per-request split counts of a plan (read from the device, outside any timed region)."""
    return [int(n) for n in p.num_splits.tolist()]


def _effective_splits(p) -> int:
    """Splits of the request that has the most (a forced count may exceed what a short request fills)."""
    return min(p.max_splits, max(_splits(p), default=1))


def sweep_shape(shape, backend: str, cfg: Config, splits: range, dtype: str = "bf16", on_step=None) -> dict:
    case = build_case(shape, DTYPES[dtype], cfg.device, cfg.seed)
    graph = cfg.graph and cfg.device.type == "cuda" and backend != "torch"
    sets = case.rotation(case.rotation_count()) if graph else [case.base]
    bound = shape.max_seqlen if graph else None
    s = shape

    def timed(p) -> float:
        fns = [lambda ts=ts: splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens,
                                            block_table=ts.block_table, causal=s.causal, plan=p, backend=backend)
               for ts in sets]
        if graph:
            return time_graph(fns, cfg.device, cfg.reps)[0]
        return time_eager(fns[0], cfg.device, cfg.reps)[0]

    def plan_for(n):
        p = splitkv.plan(case.base.cache_seqlens, s.num_q_heads, s.num_kv_heads, s.head_dim, q_len=s.q_len,
                         num_splits=n, max_seqlen=bound, backend=backend, paged=s.paged)
        if bound is not None:
            p.refresh(case.base.cache_seqlens)  # once per step, before the replays
        return p

    planner = plan_for(None)
    planner_us = timed(planner)
    curve, seen = [], set()
    for n in splits:
        p = plan_for(n)
        key = (p.max_splits, tuple(_splits(p)))
        if key not in seen:
            seen.add(key)
            curve.append({"num_splits": n, "splits": _effective_splits(p), "us": timed(p)})
        if on_step:
            on_step(shape.name, n)
    best = min(curve, key=lambda c: c["us"])
    case.release()
    return {
        "shape": shape.name, "mode": "graph" if graph else "eager", "backend": backend, "dtype": dtype,
        "planner_splits": _effective_splits(planner), "planner_us": planner_us,
        "planner_plan": planner.describe(), "best_splits": best["splits"],
        "best_num_splits": best["num_splits"],
        "best_us": best["us"], "regret_pct": 100.0 * (planner_us / best["us"] - 1.0), "curve": curve,
        "cmd": (f"python -m splitkv bench --suite {cfg.suite} --shapes {shape.name} "
                f"--providers splitkv-{backend} --num-splits sweep "
                f"--sweep-range {splits.start}:{splits.stop - 1}"
                + (" --device cpu" if cfg.device.type == "cpu" else "")
                + ("" if cfg.graph else " --no-graph")),
    }


def run_sweep(shapes, backend: str, cfg: Config, splits: range, on_step=None) -> list[dict]:
    return [sweep_shape(s, backend, cfg, splits, cfg.dtypes[0], on_step) for s in shapes]
