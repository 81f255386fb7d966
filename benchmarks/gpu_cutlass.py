"""H200 check + benchmark of the CuTe DSL backend (the lead runs it on the lent GPU):

    . .whl/env.sh; python benchmarks/gpu_cutlass.py --out $OUT                  # compile,correct,cache,bench
    . .whl/env.sh; python benchmarks/gpu_cutlass.py --out $OUT --phases compile,sanitize,sweep

Phases (each catches its own failures and is reported; nothing aborts the run):
  compile   every variant compiled in parallel worker processes (filling the disk cache), then
            loaded in this process (exercises the disk-cache load path); per-variant seconds
  correct   the matrix vs splitkv.reference (fp64): every split variant (dtype x D x block_m x
            paged), odd lengths incl. 0, page sizes 1..256 with shuffled tables and NaN in unused
            pages / slots, forced splits 1/3/17, causal Sq up to 16, real sizes, fp16/bf16
            partials through the combine, bitwise determinism, a CUDA-graph replay with new lengths
  cache     a fresh process decodes with kernels loaded from the disk cache only
  sanitize  compute-sanitizer memcheck and racecheck on small cases (kernels from the disk cache)
  bench     cutlass vs triton, eager (do_bench median, L2 flushed) and CUDA-graph replay (rotating
            KV buffers, cold reads) on the PEERS shapes, contiguous and paged
  sweep     cutlass (block_n, stages) alternatives on two shapes, graph replay
Results: $OUT/gpu_cutlass.json (rewritten after every phase), summary table printed last.
A phase is skipped (reported) once --budget-s wall seconds have passed.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import splitkv  # noqa: E402
from splitkv.reference import decode_lowp, decode_reference  # noqa: E402

os.environ.setdefault("SPLITKV_CACHE_DIR", "/tmp/splitkv-cutlass-cache")  # kept while the machine is warm
HERE = os.path.abspath(__file__)
RESULTS: dict = {"phases": {}}
DT = {"fp16": torch.float16, "bf16": torch.bfloat16}


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------- inputs
def make_inputs(dtype, D, Hq, Hkv, Sq, lengths, page_size=None, device="cuda", seed=0, lmax=None):
    """q, k, v, seqlens, block_table (None when contiguous) + the dense k/v for decode_lowp.
    Unused cache slots and pages hold NaN; unused block-table entries hold an out-of-range id."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(lengths)
    lmax = lmax or max(max(lengths), 1)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(device, DT[dtype])
    kd = torch.randn(B, lmax, Hkv, D, generator=g).to(device, DT[dtype])
    vd = torch.randn(B, lmax, Hkv, D, generator=g).to(device, DT[dtype])
    for b, L in enumerate(lengths):
        kd[b, L:] = float("nan")
        vd[b, L:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if page_size is None:
        return q, kd, vd, seqlens, None, kd, vd
    max_pages = -(-lmax // page_size)
    used = [-(-L // page_size) for L in lengths]
    P = sum(used) + 3  # spare pages stay NaN
    perm = torch.randperm(P, generator=g).tolist()
    kp = torch.full((P, page_size, Hkv, D), float("nan"), dtype=DT[dtype], device=device)
    vp = torch.full_like(kp, float("nan"))
    bt = torch.full((B, max_pages), 10**7, dtype=torch.int32)  # never read: would fault if it were
    nxt = 0
    for b, L in enumerate(lengths):
        for j in range(used[b]):
            pid = perm[nxt]
            nxt += 1
            bt[b, j] = pid
            lo, hi = j * page_size, min((j + 1) * page_size, L)
            kp[pid, : hi - lo] = kd[b, lo:hi]
            vp[pid, : hi - lo] = vd[b, lo:hi]
    return q, kp, vp, seqlens, bt.to(device), kd, vd


# ------------------------------------------------------------------------------------ correctness
def err_stats(o, lse, ref_o, ref_lse):
    o, lse = o.double(), lse.double()
    empty = torch.isinf(ref_lse)  # [B, Hq, Sq]: rows that see no key
    e_o = (o - ref_o).abs()
    fin = ~empty
    e_lse = (lse - ref_lse).abs()[fin]
    empty_ok = bool(torch.all(torch.isinf(lse[empty]) & (lse[empty] < 0))) and bool(
        torch.all(o.permute(0, 2, 1, 3)[empty] == 0))
    return dict(err_o=float(e_o.max()) if e_o.numel() else 0.0,
                err_lse=float(e_lse.max()) if e_lse.numel() else 0.0,
                nan=bool(torch.isnan(o).any() or torch.isnan(lse).any()), empty_ok=empty_ok)


def check_case(spec: dict, backend="cutlass", device="cuda") -> dict:
    """Run one decode through `backend` and compare with the fp64 reference."""
    q, k, v, seqlens, bt, kd, vd = make_inputs(spec["dtype"], spec["D"], spec["Hq"], spec["Hkv"], spec["Sq"],
                                               spec["lengths"], spec.get("page"), device, spec.get("seed", 0))
    causal = spec.get("causal", True)
    kw = dict(block_table=bt, causal=causal, num_splits=spec.get("splits"), return_lse=True, backend=backend)
    out = torch.full_like(q, float("nan"))  # every element must be written
    o, lse = splitkv.decode(q, k, v, seqlens, out=out, **kw)
    o2, lse2 = splitkv.decode(q, k, v, seqlens, **kw)
    ref_o, ref_lse = decode_reference(q, k, v, seqlens, block_table=bt, causal=causal)
    res = err_stats(o, lse, ref_o, ref_lse)
    res["deterministic"] = bool(torch.equal(o, o2) and torch.equal(lse.nan_to_num(), lse2.nan_to_num()))
    low = decode_lowp(q, kd, vd, seqlens, causal=causal).double()  # torch's own low-precision error
    low_err = float((low - ref_o).abs().nan_to_num(0.0).max())
    res["tol_o"] = 2 * low_err + 1e-3
    res["ok"] = (not res["nan"] and res["empty_ok"] and res["deterministic"] and res["err_o"] <= res["tol_o"]
                 and res["err_lse"] <= 2e-3)
    return res


def matrix_cases(quick=False):
    """One case per split variant (dtype x D x block_m x paged) + real sizes."""
    cases, i = [], 0
    for dtype in ("fp16", "bf16"):
        for D in (64, 128, 256):
            for G, Sq in ((4, 1), (8, 4), (16, 16)):  # 4 / 32 / 256 packed rows: block_m 16 / 32 / 64 (x4)
                for page in (None, (1, 16, 64, 256)[i % 4]):
                    cases.append(dict(name=f"{dtype} D{D} G{G} Sq{Sq} {'page' + str(page) if page else 'dense'}",
                                      dtype=dtype, D=D, Hq=2 * G, Hkv=2, Sq=Sq, page=page,
                                      lengths=[0, 1, 17, 113, 4097][: 3 if quick else 5],
                                      splits=(None, 1, 3, 17)[i % 4], causal=i % 3 != 2, seed=i))
                    i += 1
    real = [dict(name="real B1 32/8 32K bf16", dtype="bf16", D=128, Hq=32, Hkv=8, Sq=1, lengths=[32768]),
            dict(name="real B1 32/8 128K paged16", dtype="bf16", D=128, Hq=32, Hkv=8, Sq=1, lengths=[131072],
                 page=16),
            dict(name="real B16 32/32 4K fp16", dtype="fp16", D=128, Hq=32, Hkv=32, Sq=1, lengths=[4096] * 16),
            dict(name="real B4 64/8 16K paged64 fp16", dtype="fp16", D=128, Hq=64, Hkv=8, Sq=1,
                 lengths=[16384, 9000, 1, 16000], page=64),
            dict(name="real B3 32/4 Sq4 ragged paged256", dtype="bf16", D=128, Hq=32, Hkv=4, Sq=4,
                 lengths=[100000, 5, 33000], page=256),
            dict(name="real B2 8/1 D256 MQA 20K", dtype="bf16", D=256, Hq=8, Hkv=1, Sq=1, lengths=[20000, 777]),
            dict(name="real B2 28/4 G7 D64 8K", dtype="fp16", D=64, Hq=28, Hkv=4, Sq=2, lengths=[8191, 65])]
    return cases + ([] if quick else real)


def check_combine_only(device="cuda") -> list[dict]:
    """fp32/fp16/bf16 partials (merge_states users) through the cutlass combine vs fp64 math."""
    from splitkv.backends import cutlass as C

    rows = []
    for pdt in (torch.float32, torch.float16, torch.bfloat16):
        for odt in (torch.float16, torch.bfloat16):
            for D in (64, 128, 256):
                name = f"combine {str(pdt)[6:]}->{str(odt)[6:]} D{D}"
                try:
                    S, B, H, T = 37, 3, 4, 2
                    o_part = torch.randn(S, B, H, T, D, device=device).to(pdt)
                    lse_part = torch.randn(S, B, H, T, device=device) * 3
                    ns = torch.tensor([37, 1, 5], dtype=torch.int32, device=device)
                    lse_part[2:, 2] = -math.inf  # request 2: only splits 0, 1 live
                    o_part[2:, 2] = float("nan")  # ... dead partials hold NaN, which must not leak
                    lse_part[:, 1, 0] = -math.inf  # request 1, head 0: no key at all
                    out = torch.full((B, T, H, D), float("nan"), dtype=odt, device=device)
                    lse = torch.empty(B, H, T, device=device)
                    C.combine(o_part, lse_part, ns, out, lse)
                    live = torch.arange(S, device=device)[:, None] < ns[None, :]
                    lp = lse_part.double().masked_fill(~live[:, :, None, None], -math.inf)
                    m = lp.amax(0)
                    ms = torch.where(torch.isinf(m), 0.0, m)
                    w = torch.exp(lp - ms)
                    den = w.sum(0)
                    num = torch.where(w[..., None] > 0, w[..., None] * o_part.double(), 0.0).sum(0)
                    ref_o = torch.where(den[..., None] > 0, num / den.clamp_min(1e-300)[..., None], 0.0)
                    ref_l = torch.where(den > 0, ms + torch.log(den), -math.inf)
                    r = err_stats(out, lse, ref_o.permute(0, 2, 1, 3), ref_l)
                    tol = 2.0 ** -7 * float(ref_o.abs().max()) + 1e-4  # one bf16 rounding of the output
                    r["ok"] = not r["nan"] and r["empty_ok"] and r["err_o"] <= tol and r["err_lse"] < 1e-4
                except Exception as e:
                    r = dict(ok=False, error=f"{type(e).__name__}: {e}")
                rows.append(dict(name=name, **r))
    return rows


def check_graph(device="cuda") -> dict:
    """Capture decode with a graph-safe plan, replay after changing lengths in place."""
    q, k, v, seqlens, bt, _, _ = make_inputs("bf16", 128, 32, 8, 1, [5000, 3000], page_size=16, device=device,
                                             lmax=8192)
    p = splitkv.plan(seqlens, 32, 8, 128, max_seqlen=8192)
    out = torch.empty_like(q)
    kw = dict(block_table=bt, plan=p, out=out, backend="cutlass")
    splitkv.decode(q, k, v, seqlens, **kw)  # compile + module load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        splitkv.decode(q, k, v, seqlens, **kw)
    seqlens.copy_(torch.tensor([4000, 2500], dtype=torch.int32))  # shorter: pages already hold the keys
    g.replay()
    torch.cuda.synchronize()
    ref_o, _ = decode_reference(q, k, v, seqlens, block_table=bt)
    err = float((out.double() - ref_o).abs().max())
    return dict(name="graph replay, new lengths", err_o=err, ok=err < 2e-2 and not torch.isnan(out).any().item())


# ------------------------------------------------------------------------------------------ phases
def phase_compile(args):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.cache import CACHE
    from splitkv.compile_cli import variants

    arch = launch.arch_of(torch.device("cuda"))
    todo = variants()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(min(12, os.cpu_count() or 4), mp_context=get_context("spawn")) as ex:
        warm = list(ex.map(_warm_one, todo, [arch] * len(todo)))
    rows = [dict(name=n, warm_s=s, ok=ok, error=e) for n, s, ok, e in warm]
    log(f"parallel compile of {len(todo)} variants: {time.perf_counter() - t0:.0f} s")
    for row, (kind, fields) in zip(rows, todo):
        t = time.perf_counter()
        try:
            cfg = _cfg(kind, fields)
            (launch.compile_split if kind == "split" else launch.compile_combine)(cfg, arch)
            row["load_s"] = round(time.perf_counter() - t, 2)
        except Exception as e:
            row.update(ok=False, error=f"load: {type(e).__name__}: {e}")
    row_stats = dict(CACHE.stats)
    log(f"in-process: {row_stats} (disk = loaded from the disk cache, compiled = disk load failed)")
    return dict(rows=rows, cache_stats=row_stats, ok=all(r["ok"] for r in rows) and row_stats["compiled"] == 0)


def _cfg(kind, fields):
    from splitkv.backends.cutlass.config import CombineConfig, SplitConfig

    return SplitConfig(*fields) if kind == "split" else CombineConfig(*fields)


def _warm_one(item, arch):
    kind, fields = item
    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.cache import CACHE

    cfg = _cfg(kind, fields)
    t = time.perf_counter()
    try:
        CACHE.get(cfg.name, arch, lambda: (launch.build_split if kind == "split" else launch.build_combine)(cfg))
        return cfg.name, round(time.perf_counter() - t, 2), True, None
    except Exception as e:
        return cfg.name, round(time.perf_counter() - t, 2), False, f"{type(e).__name__}: {str(e)[:300]}"


def _run_rows(items, fn):
    rows = []
    for item in items:
        try:
            r = dict(name=item["name"], **fn(item))
        except Exception as e:
            r = dict(name=item["name"], ok=False, error=f"{type(e).__name__}: {e}",
                     trace=traceback.format_exc()[-1500:])
        log(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['name']:40s} err_o={r.get('err_o', float('nan')):.2e} "
            f"err_lse={r.get('err_lse', float('nan')):.2e} {r.get('error', '')}")
        rows.append(r)
    return rows


def phase_correct(args):
    rows = _run_rows(matrix_cases(args.quick), check_case)
    for r in check_combine_only():
        log(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['name']:40s} err_o={r.get('err_o', float('nan')):.2e} "
            f"{r.get('error', '')}")
        rows.append(r)
    rows += _run_rows([dict(name="graph replay")], lambda _: check_graph())
    return dict(rows=rows, ok=all(r["ok"] for r in rows), passed=sum(r["ok"] for r in rows), total=len(rows))


SMALL = [dict(name="small dense fp16 D128 G4", dtype="fp16", D=128, Hq=8, Hkv=2, Sq=1, lengths=[300, 17], splits=3),
         dict(name="small page1 bf16 D64 G8 Sq4", dtype="bf16", D=64, Hq=16, Hkv=2, Sq=4, lengths=[129, 0], page=1,
              splits=2),
         dict(name="small page16 bf16 D256 G16 Sq16", dtype="bf16", D=256, Hq=16, Hkv=1, Sq=16,
              lengths=[70, 9], page=16)]


def _child(args):
    """Subprocess entry: run SMALL through the cutlass backend, print one JSON line."""
    from splitkv.backends.cutlass.cache import CACHE

    rows = []
    for spec in SMALL:
        try:
            rows.append(dict(name=spec["name"], **check_case(spec)))
        except Exception as e:
            rows.append(dict(name=spec["name"], ok=False, error=f"{type(e).__name__}: {e}"))
    print("CHILD_RESULT " + json.dumps(dict(rows=rows, cache_stats=dict(CACHE.stats))), flush=True)


def _spawn(prefix, timeout):
    cmd = prefix + [sys.executable, HERE, "--child"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(ok=False, error=f"timeout after {timeout} s: {' '.join(cmd)}")
    res = next((json.loads(line[13:]) for line in p.stdout.splitlines() if line.startswith("CHILD_RESULT ")), None)
    tail = (p.stdout + p.stderr)[-3000:]
    return dict(returncode=p.returncode, child=res, tail=tail)


def phase_cache(args):
    r = _spawn([], 300)
    child = r.get("child") or {}
    stats = child.get("cache_stats", {})
    ok = (r.get("returncode") == 0 and bool(child) and all(x["ok"] for x in child["rows"])
          and stats.get("compiled", 1) == 0 and stats.get("disk", 0) > 0)
    log(f"  {'PASS' if ok else 'FAIL'}  fresh process, disk cache only: {stats}")
    return dict(ok=ok, **r)


def phase_sanitize(args):
    out = {}
    for tool in ("memcheck", "racecheck"):
        r = _spawn(["compute-sanitizer", "--tool", tool, "--error-exitcode", "99"], 280)
        summary = [line for line in r.get("tail", "").splitlines() if "ERROR SUMMARY" in line or "RACECHECK SUMMARY" in line]
        child = r.get("child") or {}
        ok = r.get("returncode") == 0 and bool(child) and all(x["ok"] for x in child["rows"])
        log(f"  {'PASS' if ok else 'FAIL'}  compute-sanitizer {tool}: rc={r.get('returncode')} {summary}")
        out[tool] = dict(ok=ok, summary=summary, **r)
    return dict(ok=all(v["ok"] for v in out.values()), **out)


# ---------------------------------------------------------------------------------------- timing
def graph_us(make_call, copies, n_calls=20, reps=15):
    """Median replay time / n_calls of a graph of n_calls calls cycling over `copies` input sets."""
    for i in range(copies):
        make_call(i)()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(n_calls):
            make_call(j % copies)()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n_calls)
    return sorted(times)[len(times) // 2]


BENCH = [(1, 32, 8, 4096), (1, 32, 8, 32768), (1, 32, 8, 131072), (16, 32, 32, 32768)]


def _bench_shape(B, Hq, Hkv, L, page, backends_, split_cfg=None):
    import triton

    D, dtype = 128, "bf16"
    kv_bytes = 2 * B * L * Hkv * D * 2
    copies = max(1, min(16, -(-240_000_000 // kv_bytes)))
    sets = [make_inputs(dtype, D, Hq, Hkv, 1, [L] * B, page, seed=i)[:5] for i in range(copies)]
    p = splitkv.plan(sets[0][3], Hq, Hkv, D)
    outs = [torch.empty_like(s[0]) for s in sets]
    row = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, page=page, kv_mb=round(kv_bytes / 1e6, 1), splits=p.max_splits)
    for be in backends_:
        def call(i, be=be):
            q, k, v, sl, bt = sets[i]
            if split_cfg is not None:
                return lambda: _split_direct(q, k, v, sl, bt, p, outs[i], split_cfg)
            return lambda: splitkv.decode(q, k, v, sl, block_table=bt, plan=p, out=outs[i], backend=be)
        try:
            call(0)()
            eager = triton.testing.do_bench(call(0), warmup=25, rep=200, return_mode="median") * 1e3
            gr = graph_us(call, copies)
            row[be] = dict(eager_us=round(eager, 1), graph_us=round(gr, 1),
                           graph_tbps=round(kv_bytes / gr / 1e6, 2), eager_tbps=round(kv_bytes / eager / 1e6, 2))
        except Exception as e:
            row[be] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


def _split_direct(q, k, v, seqlens, bt, p, out, cfg):
    from splitkv.backends.cutlass import launch

    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    o_part, lse_part = p.partials()
    launch.split_(q, k, v, seqlens, bt, p, o_part, lse_part, out, lse, q.shape[-1] ** -0.5, True, cfg=cfg)
    if o_part is not None:
        launch.combine_(o_part, lse_part, p.num_splits, out, lse, skip_single=True)


def phase_bench(args):
    rows = []
    for B, Hq, Hkv, L in BENCH:
        for page in (None, 16):
            r = _bench_shape(B, Hq, Hkv, L, page, ("cutlass", "triton"))
            torch.cuda.empty_cache()  # the input sets of this shape are gone
            log(f"  B{B} {Hq}/{Hkv} L{L} {'page16' if page else 'dense'} splits={r['splits']}: "
                + "  ".join(f"{be} {r[be]}" for be in ("cutlass", "triton")))
            rows.append(r)
    return dict(rows=rows, ok=True)


def phase_sweep(args):
    from splitkv.backends.cutlass.config import SplitConfig

    rows = []
    for B, Hq, Hkv, L in ((1, 32, 8, 32768), (16, 32, 32, 32768)):
        for bn, st in ((64, 2), (64, 3), (64, 4), (64, 5), (128, 2), (128, 3)):
            rows_m = min(max(1 << max(0, (Hq // Hkv - 1).bit_length()), 16), 64)
            try:
                cfg = SplitConfig("bfloat16", 128, rows_m, bn, st, False)
                r = _bench_shape(B, Hq, Hkv, L, None, ("cutlass",), split_cfg=cfg)
            except Exception as e:
                r = dict(B=B, L=L, cutlass=dict(error=str(e)[:200]))
            r["tile"] = f"n{bn}_s{st}"
            log(f"  sweep B{B} {Hq}/{Hkv} L{L} {r['tile']}: {r['cutlass']}")
            rows.append(r)
    return dict(rows=rows, ok=True)


PHASES = {"compile": phase_compile, "correct": phase_correct, "cache": phase_cache, "sanitize": phase_sanitize,
          "bench": phase_bench, "sweep": phase_sweep}


def summary():
    log("\n==== gpu_cutlass summary ====")
    for name, res in RESULTS["phases"].items():
        extra = ""
        if name == "correct" and "passed" in res:
            extra = f"{res['passed']}/{res['total']} passed; failed: " + ", ".join(
                r["name"] for r in res["rows"] if not r["ok"])[:600]
        if name == "bench":
            extra = "\n" + "\n".join(
                f"    B{r['B']} {r['Hq']}/{r['Hkv']} L{r['L']} {'p16' if r['page'] else 'dense'}: "
                f"cutlass {r['cutlass'].get('graph_us', r['cutlass'].get('error'))} us graph / "
                f"{r['cutlass'].get('eager_us', '-')} eager; triton {r['triton'].get('graph_us', '-')} / "
                f"{r['triton'].get('eager_us', '-')}" for r in res.get("rows", []))
        if name == "sweep":
            extra = "\n" + "\n".join(f"    B{r['B']} L{r['L']} {r['tile']}: {r['cutlass'].get('graph_us', r['cutlass'])}"
                                     for r in res.get("rows", []))
        log(f"  {name:9s} {res.get('status', 'PASS' if res.get('ok') else 'FAIL')} {extra}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--phases", default="compile,correct,cache,bench")
    ap.add_argument("--quick", action="store_true", help="fewer lengths, no real sizes")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    RESULTS["env"] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                          cache_dir=os.environ["SPLITKV_CACHE_DIR"], date=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        import importlib.metadata as md

        RESULTS["env"]["cutlass_dsl"] = md.version("nvidia-cutlass-dsl")
    except Exception as e:
        RESULTS["env"]["cutlass_dsl"] = f"? ({e})"
    log(json.dumps(RESULTS["env"]))
    for name in args.phases.split(","):
        if time.perf_counter() - t0 > args.budget_s:
            RESULTS["phases"][name] = dict(status="SKIPPED (budget)")
            continue
        log(f"== phase {name}")
        t = time.perf_counter()
        try:
            res = PHASES[name](args)
        except Exception as e:
            res = dict(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
            log(res["trace"])
        res["seconds"] = round(time.perf_counter() - t, 1)
        RESULTS["phases"][name] = res
        with open(os.path.join(args.out, "gpu_cutlass.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    summary()


if __name__ == "__main__":
    main()
