"""Probe (waiting for a GPU run): ragged batches whose B x KV heads fills the SMs (heuristics: the
"full grid" rule keeps FULL_GRID_MAX_SPLITS = 4 split columns, so no request gets more than 4
splits, whatever the spread of lengths). On the planner's own arithmetic (CPU, 132 SMs, two CTAs
per SM, GQA 32/8, lengths 1K..128K geometric) the longest CTA then streams 2.17x the ideal
per-slot work at B=17, 1.58x at B=24, 1.20x at B=32 (1.88x at B=16 on a 108-SM GPU); below the
rule's threshold (B=16 on 132 SMs) the ragged re-plan reaches 1.00.

States, graph replay, a plan per state, interleaved twice (min), Triton and CuTe:
  cols4  the library: a (request, split) grid of 4 columns
  list   a work list of ragged_target (4 x B) items per KV head: as many CTAs as cols4, but any
         request may take up to 4 x B splits (the schedule's balanced re-plan)
  colsR  the grid with MAX_SPLITS (128) columns (balanced; many more empty CTAs)
Planner arithmetic of the states (CPU): makespan / ideal cols4 2.17 / 1.58 / 1.20 at B = 17 / 24 /
32 ragged, list and colsR 1.00 (68 / 95 / 128 splits); the uniform rows plan the same splits in all
three.
Uniform rows show what the list or the extra columns cost where nothing is ragged.
Prediction: list ~= colsR on the ragged rows, 1.2-2x faster than cols4 at B=17-24; within a few %
of cols4 on the uniform rows (the same CTA count; #58's column cost is the open question).
Run from the repository root: PYTHONPATH=. python benchmarks/probes/probe_full_grid_ragged.py
"""
import torch

import splitkv
from splitkv import execute
from splitkv import heuristics as H
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph

dev = torch.device("cuda")
ITEMS, FULL = H.work_items, H.FULL_GRID_MAX_SPLITS


def listed(rule, batch):
    if rule.mode != "auto" or rule.max_splits == 1:
        return None
    return min(max(rule.ragged_target, rule.target, batch), batch * rule.max_splits)


def state(name):
    H.FULL_GRID_MAX_SPLITS = FULL if name == "cols4" else H.MAX_SPLITS
    H.work_items = listed if name == "list" else ITEMS
    execute.clear_plans()


def geo(B):
    return [int(1024 * 2 ** (7 * i / (B - 1))) for i in range(B)]


ROWS = [(17, geo(17)), (24, geo(24)), (32, geo(32)), (24, [32768] * 24), (32, [4096] * 32)]
for backend in ("triton", "cutlass"):
    for B, lens in ROWS:
        case = build_case(make_shape(B, lens, 32, 8), torch.bfloat16, "cuda")
        sets = case.rotation(case.rotation_count())
        res, desc, outs = {}, {}, {}
        for _ in range(2):
            for name in ("cols4", "list", "colsR"):
                state(name)
                p = splitkv.plan(sets[0].cache_seqlens, 32, 8, 128, max_seqlen=max(lens), backend=backend)
                p.refresh(sets[0].cache_seqlens)
                fns = [lambda t=t, p=p: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, plan=p) for t in sets]
                outs[name] = fns[0]().clone()
                desc[name] = (f"max_splits {p.max_splits}, "
                              f"{'list ' + str(p.work_items) if p.work is not None else 'grid'}")
                res.setdefault(name, []).append(time_graph(fns, dev, 20)[0])
        state("cols4")
        err = max((outs[n].float() - outs["cols4"].float()).abs().max().item() for n in outs)
        tag = f"L={lens[0]}" if len(set(lens)) == 1 else f"ragged {min(lens)}..{max(lens)}"
        print(f"{backend} B={B} {tag} 32/8 bf16, us (min of 2): " + " | ".join(
            f"{n} {min(res[n]):.1f} ({desc[n]})" for n in ("cols4", "list", "colsR"))
            + f" | max diff vs cols4 {err:.1e}", flush=True)
        case.release()
