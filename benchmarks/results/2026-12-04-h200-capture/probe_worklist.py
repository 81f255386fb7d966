"""Probe (call 8): CuTe plans with ragged headroom, (request, split) grid vs a work list of ragged_target items.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-capture/probe_worklist.py
"""
import torch

import splitkv
from splitkv import heuristics as H
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

real = H.work_items


def headroom(rule, batch):
    if rule.mode != "auto" or rule.max_splits == 1:
        return None
    full = batch * rule.max_splits
    items = min(max(rule.ragged_target, rule.target, batch), full)
    return items if items * 2 <= full else None


for B, L, Hq, Hkv, page in [(8, 32768, 32, 8, None), (8, 4096, 32, 8, None), (16, 32768, 32, 8, None),
                            (16, 131072, 32, 8, None), (4, 32768, 32, 32, None), (8, 32768, 32, 8, 16)]:
    case = build_case(make_shape(B, L, Hq, Hkv, page_size=page), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    res = {}
    for mode, fn in (("grid", real), ("list", headroom)):
        H.work_items = fn
        ts = case.base
        p = splitkv.plan(ts.cache_seqlens, Hq, Hkv, 128, max_seqlen=L, paged=page is not None)
        outs = [time_graph([lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens,
                                                       block_table=t.block_table, plan=p) for t in sets],
                           torch.device("cuda"), 20)[0] for _ in range(2)]
        o = splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, block_table=ts.block_table, plan=p)
        res[mode] = (outs, o, p.work_items, p.max_splits, p.backend)
    H.work_items = real
    same = torch.equal(res["grid"][1], res["list"][1])
    print(f"B={B} L={L} {Hq}/{Hkv} page={page} {res['grid'][4]}: grid(max_splits {res['grid'][3]}) "
          f"{' '.join(f'{u:.1f}' for u in res['grid'][0])} | list({res['list'][2]} items) "
          f"{' '.join(f'{u:.1f}' for u in res['list'][0])} | equal {same}", flush=True)
    case.release()
