"""Probe: the first graph timing after the bench's fp64 reference reads ~41 us at B=1 GQA 32/8 32K
(probe_order.txt). Is it time (a settle pause cures it) or the first graph after it (a throwaway
graph cures it)? SM clock (torch.cuda.clock_rate, NVML) read before each timing.

Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-layout/probe_settle.py
"""
import time

import torch

import splitkv
from splitkv.bench.check import build_reference
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
case = build_case(make_shape(1, 32768, 32, 8), torch.bfloat16, "cuda")
sets = case.rotation(case.rotation_count())
p = splitkv.plan(sets[0].cache_seqlens, 32, 8, 128, max_seqlen=32768)
fns = [lambda t=t: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p) for t in sets]


def clock():
    try:
        return torch.cuda.clock_rate(dev)
    except Exception as e:  # noqa: BLE001 - NVML may be absent
        return type(e).__name__


def graph(label):
    c = clock()
    us = [time_graph(fns, dev, 20)[0] for _ in range(2)]
    print(f"{label}: {us[0]:.1f} {us[1]:.1f} us (SM clock before: {c})", flush=True)


graph("fresh")
for pause in (0.0, 0.05, 0.2, 1.0, 0.0):
    build_reference(case)
    torch.cuda.synchronize()
    time.sleep(pause)
    graph(f"after the reference, {pause} s pause")
build_reference(case)
torch.cuda.synchronize()
time_graph(fns[:1], dev, 3)  # a throwaway graph of one call
graph("after the reference and a throwaway graph")

# second part (call 10): which graph does the cure need, and is it the captured output's memory?
outs = [torch.empty_like(t.q) for t in sets]
with_out = [lambda t=t, o=o: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p, out=o)
            for t, o in zip(sets, outs)]
build_reference(case)
torch.cuda.synchronize()
us = [time_graph(with_out, dev, 20)[0] for _ in range(2)]
print(f"after the reference, out= allocated outside the graph: {us[0]:.1f} {us[1]:.1f} us", flush=True)
build_reference(case)
torch.cuda.synchronize()
x = torch.zeros(1024, device=dev)
time_graph([lambda: x.add_(1)], dev, 3)  # a throwaway graph of a torch op
graph("after the reference and a throwaway torch-op graph")
build_reference(case)
torch.cuda.synchronize()
graph("after the reference (control)")
