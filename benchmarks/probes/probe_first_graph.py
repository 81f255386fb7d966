"""Probe (GPU): the graph rows of the first provider at a B=1 fp8 shape run ~15% slower than the
same provider's later rows (H100, 2026-12-05: splitkv-triton B=1 GQA 32/8 128K e4m3 116.4 us as
the shape's first provider vs 101.3 as its second; splitkv-cutlass 116.8 first vs 100.7 second),
in both of a row's captures. runner.GRAPH_CAPTURES takes the faster of two, which covered the
bf16 case (NOTES #54's neighbour in runner.py) but not this one.

Each shape: its case and fp64 reference are built as the runner builds them, then providers
triton, cutlass, triton, cutlass are measured in turn with 4 captures per graph row. Prediction:
if the penalty is time or state after the reference, the first row's later captures recover and
the second triton row matches the cutlass rows' level; if it is the provider's own first graph,
the repeated providers recover only on their second row.
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_first_graph.py
"""
import time

import torch

from splitkv.bench import registry, runner
from splitkv.bench.check import build_reference
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape

runner.GRAPH_CAPTURES = 4
cfg = runner.Config(device=torch.device("cuda"), suite="fp8", reps=10, host=False)
for shape in (make_shape(1, 131072, 32, 8, kv_dtype="fp8_e4m3"),
              make_shape(1, 131072, 32, 8, page_size=16, kv_dtype="fp8_e4m3"),
              make_shape(1, 32768, 32, 32, kv_dtype="fp8_e4m3")):
    case = build_case(shape, torch.bfloat16, cfg.device, cfg.seed)
    t0 = time.perf_counter()
    ref = build_reference(case)
    torch.cuda.synchronize()
    print(f"{shape.name}: reference {time.perf_counter() - t0:.2f} s", flush=True)
    for name in ("splitkv-triton", "splitkv-cutlass", "splitkv-triton", "splitkv-cutlass"):
        row = runner.measure(case, ref, registry.make(name), cfg, "bf16")
        print(f"  {name:16s} eager {row['eager_us']:7.1f}  graph captures {row['graph_captures_us']}", flush=True)
    case.release()
    del case, ref
    torch.cuda.empty_cache()
