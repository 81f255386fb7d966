"""Probe: Triton fp8 (word-read tile) plans of batches that fill the GPU: the (request, split) grid
as planned vs a work list of the same items (heuristics.work_items forced to ragged_target items)
vs a one-column grid (FULL_GRID_MAX_SPLITS = 1), graph replay, e4m3, states interleaved twice.
Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-fp8v/probe_list.py
"""
import torch

import splitkv
from splitkv import heuristics as H
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
ITEMS = H.work_items


def forced_items(rule, batch):
    if rule.mode != "auto" or rule.max_splits == 1:
        return None
    return min(max(rule.ragged_target, rule.target, batch), batch * rule.max_splits)


def state(name):
    H.work_items = forced_items if name == "list" else ITEMS
    H.FULL_GRID_MAX_SPLITS = 1 if name == "cols1" else 4
    H.uniform_schedule.cache_clear()


ROWS = [(16, 32768, 32, 32), (64, 32768, 32, 8), (16, [2048 * (i + 1) for i in range(16)], 32, 32),
        (64, [512 * (i + 1) for i in range(64)], 32, 8)]
for B, L, Hq, Hkv in ROWS:
    case = build_case(make_shape(B, L, Hq, Hkv, kv_dtype="fp8_e4m3"), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    kw = case.call_kwargs
    bound = L if isinstance(L, int) else max(L)
    res, desc = {}, {}
    for _ in range(2):
        for name in ("grid", "list", "cols1"):
            state(name)
            p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=bound, kv_dtype=sets[0].k_cache.dtype,
                             backend="triton", **kw)
            p.refresh(sets[0].cache_seqlens)
            fns = [lambda t=t, p=p: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p, **kw)
                   for t in sets]
            out = fns[0]().clone()
            desc[name] = f"items {p.work_items if p.work is not None else None}, fuse {p.fuse}"
            res.setdefault(name, []).append(time_graph(fns, dev, 20)[0])
            res.setdefault(name + "_out", []).append(out)
    state("grid")
    same = torch.equal(res["grid_out"][0], res["list_out"][0])
    tag = f"L={L}" if isinstance(L, int) else f"ragged {min(L)}..{max(L)}"
    print(f"B={B} {tag} {Hq}/{Hkv} e4m3, us (min of 2): " + " | ".join(
        f"{n} {min(res[n]):.1f} ({desc[n]})" for n in ("grid", "list", "cols1")) + f" | list output equal {same}",
        flush=True)
    case.release()
