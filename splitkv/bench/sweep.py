"""`--num-splits sweep`: the planner's report card.

For each shape, time splitkv with every forced num_splits in a range (plans that come out
identical — same grid and chunk lengths — are timed once) and with the planner's own plan; report
the planner's pick, the best measured, and the regret = planner time / best forced time - 1 (%).
Negative regret means the planner's plan beat every forced count. Graph mode (CUDA) times
graph-safe plans under CUDA-graph replay, as a server would run them; eager mode times eager plans
with the L2 flushed. Timing only: correctness is the main table's and the tests' job.
"""

from __future__ import annotations

import math

from .. import api
from ..plan import plan as make_plan
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


def _effective_splits(p, seqlens) -> int:
    """Non-empty splits of the longest request (a forced count may leave trailing empty splits)."""
    chunks = [p.chunk_len or p.max_chunk_len] * len(seqlens) if p.graph_safe else p.chunk_lens.tolist()
    return max(min(p.max_splits, max(1, math.ceil(L / c))) for L, c in zip(seqlens, chunks, strict=True))


def sweep_shape(shape, backend: str, cfg: Config, splits: range, dtype: str = "bf16", on_step=None) -> dict:
    case = build_case(shape, DTYPES[dtype], cfg.device, cfg.seed)
    graph = cfg.graph and cfg.device.type == "cuda" and backend != "torch"
    sets = case.rotation(case.rotation_count()) if graph else [case.base]
    bound = shape.max_seqlen if graph else None
    s = shape

    def timed(p) -> float:
        fns = [lambda ts=ts: api.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens,
                                        block_table=ts.block_table, causal=s.causal, plan=p, backend=backend)
               for ts in sets]
        if graph:
            return time_graph(fns, cfg.device, cfg.reps)[0]
        return time_eager(fns[0], cfg.device, cfg.reps)[0]

    def plan_for(n):
        return make_plan(case.base.cache_seqlens, s.num_q_heads, s.num_kv_heads, s.head_dim, q_len=s.q_len,
                         num_splits=n, max_seqlen=bound)

    planner = plan_for(None)
    planner_us = timed(planner)
    curve, seen = [], set()
    for n in splits:
        p = plan_for(n)
        key = (p.max_splits, p.chunk_len if p.graph_safe else tuple(p.chunk_lens.tolist()))
        if key not in seen:
            seen.add(key)
            curve.append({"num_splits": n, "splits": _effective_splits(p, s.seqlens), "us": timed(p)})
        if on_step:
            on_step(shape.name, n)
    best = min(curve, key=lambda c: c["us"])
    case.release()
    return {
        "shape": shape.name, "mode": "graph" if graph else "eager", "backend": backend, "dtype": dtype,
        "planner_splits": _effective_splits(planner, s.seqlens), "planner_us": planner_us,
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
