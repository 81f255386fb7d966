"""Probe: A/B in one process of this tree's two changes, interleaved (A B A B), bf16 D 128.

1. The split scheduler launched with programmatic dependent launch ahead of the CuTe split kernel
   (DecodePlan.schedule_pdl): small shapes, `decode(q, k, v, lens)` with no plan, eager (L2
   flushed) and graph replay; "off" patches the property to False.
2. The several-wave tile (heuristics.WAVES_TILE, n128 s3): large uniform batches, graph replay
   with a graph-safe plan; "off" patches heuristics.streams_in_waves to False (the plan's old tile).

Ran (call 2) on the tree of commit "CuTe plans streaming whole sequences in several waves take n128
s3 ...", whose DecodePlan.schedule_pdl part 1 toggles; PDL on the scheduler was reverted after this
run (NOTES #51), so part 1 needs that tree. Its part 2 ran with the waves threshold at one CTA per SM.
Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-waves/probe_ab.py
"""
import importlib

import torch

import splitkv
from splitkv import execute
from splitkv import heuristics as H
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_eager, time_graph

dev = torch.device("cuda")
P = importlib.import_module("splitkv.plan")  # the module (splitkv.plan is also the function)
PDL = P.DecodePlan.schedule_pdl
WAVES = H.streams_in_waves


def pdl(on: bool):
    P.DecodePlan.schedule_pdl = PDL if on else property(lambda self: False)


print("1. schedule with PDL, no plan: eager (L2 flushed) / graph, us (min of 2 per state)", flush=True)
for B, L, Hq, Hkv in ((1, 4096, 32, 8), (1, 4096, 64, 8), (1, 4096, 32, 32), (4, 4096, 32, 8), (1, 32768, 32, 8)):
    case = build_case(make_shape(B, L, Hq, Hkv), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    fns = [lambda s=s: splitkv.decode(s.q, s.k_cache, s.v_cache, s.cache_seqlens) for s in sets]
    res = {True: ([], []), False: ([], [])}
    for on in (False, True):  # compile + plan both ways outside the timing
        pdl(on)
        fns[0]()
    for _ in range(2):
        for on in (False, True):
            pdl(on)
            res[on][0].append(time_eager(fns[0], dev, 200)[0])
            res[on][1].append(time_graph(fns, dev, 20)[0])
    o = {}
    for on in (False, True):
        pdl(on)
        o[on] = fns[0]()
    pdl(True)
    print(f"B={B} L={L} {Hq}/{Hkv}: eager off {min(res[False][0]):.2f} on {min(res[True][0]):.2f} | "
          f"graph off {min(res[False][1]):.2f} on {min(res[True][1]):.2f} | outputs equal "
          f"{torch.equal(o[False], o[True])} | plan {execute._PLANS and next(reversed(execute._PLANS.values())).describe()}",
          flush=True)
    execute.clear_plans()
    case.release()

print("2. several-wave tile, graph-safe plan, graph replay, us (min of 3 per state)", flush=True)
for B, L, Hq, Hkv in ((64, 4096, 32, 32), (16, 4096, 32, 32), (16, 32768, 32, 32), (64, 32768, 32, 8),
                      (32, 4096, 32, 8)):
    case = build_case(make_shape(B, L, Hq, Hkv), torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    plans, fns, us = {}, {}, {True: [], False: []}
    for on in (False, True):
        H.streams_in_waves = WAVES if on else (lambda *a, **k: False)
        plans[on] = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L)
        fns[on] = [lambda s=s, p=plans[on]: splitkv.decode(s.q, s.k_cache, s.v_cache, s.cache_seqlens, plan=p)
                   for s in sets]
        fns[on][0]()
    H.streams_in_waves = WAVES
    for _ in range(3):
        for on in (False, True):
            us[on].append(time_graph(fns[on], dev, 20)[0])
    t = {on: f"{plans[on].tile.block_n}x{plans[on].tile.num_stages}" for on in (False, True)}
    same = torch.equal(fns[False][0](), fns[True][0]())
    print(f"B={B} L={L} {Hq}/{Hkv}: off (n{t[False]}) {min(us[False]):.1f} | on (n{t[True]}) {min(us[True]):.1f} "
          f"| {100 * (min(us[False]) / min(us[True]) - 1):+.1f}% | outputs equal {same}", flush=True)
    case.release()
