"""Probe: what before a graph timing makes B=1 GQA 32/8 32K read ~41 us instead of ~37?

One case and one plan; the plan's graph timed (splitkv.bench.timing.time_graph, two timings)
fresh, then after each step the bench's runner takes before its graph rows: the fp64 reference
(bench.check.build_reference), the L2-flushed eager timing (time_eager), the host loop
(time_host), a graph of plain calls (no plan), and once more after a pause.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-layout/probe_order.py
"""
import time

import torch

import splitkv
from splitkv.bench.check import build_reference
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_eager, time_graph, time_host

dev = torch.device("cuda")
case = build_case(make_shape(1, 32768, 32, 8), torch.bfloat16, "cuda")
sets = case.rotation(case.rotation_count())
p = splitkv.plan(sets[0].cache_seqlens, 32, 8, 128, max_seqlen=32768)
fns = [lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p) for t in sets]
plain = [lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens) for t in sets]


def graph(label, which=fns):
    us = [time_graph(which, dev, 20)[0] for _ in range(2)]
    print(f"{label}: {us[0]:.1f} {us[1]:.1f} us", flush=True)


graph("fresh")
ref = build_reference(case)
graph("after build_reference")
print("eager", round(time_eager(fns[0], dev, 20)[0], 1))
graph("after time_eager")
print("host", round(time_host(fns[0], dev)[0], 1))
graph("after time_host")
graph("plain calls", plain)
graph("plan again")
time.sleep(2)
graph("after 2 s idle")
print("eager plain", round(time_eager(plain[0], dev, 20)[0], 1))
graph("plain after its eager", plain)
graph("plan after that")
