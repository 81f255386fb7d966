"""Probe: fp8 V read as int16 words (split_kernel V_PAIRS) against the byte-by-byte V read, Triton,
e4m3 (and one e5m2 row), graph replay with a plan made per state, interleaved (A B C D, twice).

States: off   V_PAIRS False (the tree before; group-4 tile 168 registers)
        pairs V_PAIRS True, natural registers (184: two per SM), plans aim at two
        cap3  V_PAIRS True, maxnreg 168 (no spill on the CPU compile), plans aim at three where the rule does
        cap2  V_PAIRS True, maxnreg 168, plans aim at two
Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-04-h200-fp8v/probe_vpairs.py
"""
import torch

import splitkv
from splitkv import execute
from splitkv import heuristics as H
from splitkv.backends.triton import launch as TL
from splitkv.bench import inputs as I
from splitkv.bench.inputs import build_case
from splitkv.bench.shapes import make_shape
from splitkv.bench.timing import time_graph
from splitkv.reference import decode_reference

dev = torch.device("cuda")
I.KV_DTYPES["fp8_e5m2"] = torch.float8_e5m2  # for the one e5m2 row
REGS = dict(H.TRITON_FP8_TILE_REGS)
JIT = TL._split.fn


class _MaxN:  # the JIT function with maxnreg added to every launch
    def __init__(self, n):
        self.n = n

    def __getitem__(self, grid):
        def run(*a, **kw):
            return JIT[grid](*a, **kw, maxnreg=self.n)
        return run


def state(name):
    TL.V_PAIRS = name != "off"
    TL._split.fn = _MaxN(168) if name.startswith("cap") else JIT
    TL._split.cache.clear()
    regs = dict(REGS)
    if name == "pairs" or name == "cap2":
        regs = {k: 208 for k in REGS}  # two per SM everywhere
    elif name == "cap3":
        regs[(128, None)] = regs[(128, (4, 1))] = 168
    H.TRITON_FP8_TILE_REGS.clear()
    H.TRITON_FP8_TILE_REGS.update(regs)
    H.uniform_schedule.cache_clear() if hasattr(H.uniform_schedule, "cache_clear") else None
    execute.clear_plans()


STATES = ("off", "pairs", "cap3", "cap2")
ROWS = [(1, 131072, 32, 8, None, "fp8_e4m3"), (1, 131072, 32, 8, 16, "fp8_e4m3"), (1, 32768, 32, 32, None, "fp8_e4m3"),
        (1, 32768, 32, 32, 16, "fp8_e4m3"), (16, 32768, 32, 8, None, "fp8_e4m3"), (16, 32768, 32, 8, 16, "fp8_e4m3"),
        (16, 32768, 32, 32, None, "fp8_e4m3"), (1, 131072, 32, 8, None, "fp8_e5m2")]
print("graph replay us per call (min of 2 per state); err = max |o - fp64 reference| / max |ref|", flush=True)
for B, L, Hq, Hkv, ps, kv in ROWS:
    try:
        shape = make_shape(B, L, Hq, Hkv, page_size=ps, kv_dtype=kv)
    except Exception as e:  # e5m2 may not be a bench dtype
        print(f"skip {B} {L} {Hq}/{Hkv} {kv}: {e}", flush=True)
        continue
    case = build_case(shape, torch.bfloat16, "cuda")
    sets = case.rotation(case.rotation_count())
    kw = case.call_kwargs
    us, desc, outs = {s: [] for s in STATES}, {}, {}
    for rnd in range(2):
        for s in STATES:
            state(s)
            p = splitkv.plan(sets[0].cache_seqlens, Hq, Hkv, 128, max_seqlen=L, kv_dtype=sets[0].k_cache.dtype,
                             paged=ps is not None, **kw)
            p.refresh(sets[0].cache_seqlens)
            fns = [lambda t=t, p=p: splitkv.decode(t.q, t.k_cache, t.v_cache, t.cache_seqlens, block_table=t.block_table,
                                                   plan=p, **kw) for t in sets]
            outs[s] = fns[0]().clone()
            us[s].append(time_graph(fns, dev, 20)[0])
            desc[s] = p.describe() if rnd == 0 else desc[s]
    t = sets[0]
    ro, _ = decode_reference(t.q, t.k_cache, t.v_cache, t.cache_seqlens, block_table=t.block_table, **kw)
    ref = ro.double()
    err = {s: ((outs[s].double() - ref).abs().max() / ref.abs().max()).item() for s in STATES}
    same = all(torch.equal(outs["off"], outs[s]) for s in STATES)
    print(f"B={B} L={L} {Hq}/{Hkv} page {ps} {kv}: " + " | ".join(
        f"{s} {min(us[s]):.1f} (err {err[s]:.1e})" for s in STATES) + f" | bitwise equal {same}", flush=True)
    print("   plans: " + " || ".join(f"{s}: {desc[s]}" for s in ("off", "cap3")), flush=True)
    case.release()
    state("pairs")
