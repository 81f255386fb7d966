"""Probe (GPU): Triton's fused merge against its merge kernel at B=1 GQA 32/8 (4K, 32K), host, eager, graph.

A Triton split plan past heuristics.FUSED_MERGE_MAX_SPLITS (8) launches split + merge kernel: two C
launches per call, where a fused plan (the last split program of a group merges, via counters)
launches one. B=1 GQA 4K splits 16 ways, so a Triton decode(plan=p) there pays two launches of
host time (16.9 us on an H100 host against CuTe's 12.7, whose fused merge takes 8 rows x 16 splits).
Rows: for each length, a Triton plan made under tile_override(fused_merge=False) and (=True), and
the CuTe plan for scale: host us per call (time_host, best of 3), eager us (memset flush and read
flush), graph replay us, and the max |error| against the fp64 reference.
Prediction: the fused plan's host time ~4 us lower (one launch less); its GPU time higher by the
serial merge walk measured on the H200 (4K 15.2 vs 11.6 us, heuristics.FUSED_MERGE_MAX_SPLITS).
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_triton_fuse_b1.py
"""
import json
import os

import torch

import splitkv
from splitkv import heuristics as H
from splitkv import reference as R
from splitkv.bench.timing import time_eager, time_graph, time_host


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for length in (4096, 32768):
        q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, length, 8, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((1,), length, device=dev, dtype=torch.int32)
        exact = R.decode_reference(q.cpu(), k.cpu(), v.cpu(), lens.cpu())[0]
        for backend, fused in (("triton", False), ("triton", True), ("cutlass", None)):
            with H.tile_override(fused_merge=fused):
                p = splitkv.plan(lens, 32, 8, 128, backend=backend, max_seqlen=length, dtype=torch.bfloat16)

            def call(p=p):
                return splitkv.decode(q, k, v, lens, plan=p)

            err = (call().double().cpu() - exact).abs().max().item()
            row = dict(L=length, backend=backend, fused=p.fuse, splits=p.max_splits,
                       host_us=round(min(time_host(call, dev)[0] for _ in range(3)), 1),
                       eager_us=round(time_eager(call, dev, 20)[0], 1),
                       eager_read_us=round(time_eager(call, dev, 20, flush="read")[0], 1),
                       graph_us=round(time_graph([call], dev, 20)[0], 1), err=err)
            print(row, flush=True)
            rows.append(row)
    with open(os.path.join(os.environ.get("OUT", "."), "fuse_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
