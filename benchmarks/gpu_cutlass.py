"""H200 check + benchmark of the CuTe DSL backend (the lead runs it on the lent GPU):

    . .whl/env.sh; python benchmarks/gpu_cutlass.py --out $OUT                  # compile,correct,cache,bench
    . .whl/env.sh; python benchmarks/gpu_cutlass.py --out $OUT --phases compile,sanitize,sweep

Phases (each catches its own failures and is reported; nothing aborts the run):
  compile   every variant compiled in parallel worker processes (filling the disk cache), then
            loaded in this process (exercises the disk-cache load path); per-variant seconds
  correct   the matrix vs splitkv.reference (fp64): every split variant (dtype x D x block_m x
            paged), odd lengths incl. 0, page sizes 1..256 with shuffled tables and NaN in unused
            pages / slots, forced splits 1/3/17, causal Sq up to 16, real sizes, fp16/bf16
            partials through the merge, bitwise determinism, a CUDA-graph replay with new lengths
  cache     a fresh process decodes with kernels loaded from the disk cache only
  sanitize  compute-sanitizer memcheck and racecheck on small cases (kernels from the disk cache)
  bench     cutlass vs triton, eager (do_bench median, L2 flushed) and CUDA-graph replay (rotating
            KV buffers, cold reads) on the PEERS shapes, contiguous and paged
  sweep     cutlass (block_n, stages) alternatives on two shapes, graph replay
  pdl       fused merge vs merge kernel, programmatic dependent launch on / off, split kernel alone,
            and Triton, graph replay + eager, on small and mid GQA shapes
Results: $OUT/gpu_cutlass.json (rewritten after every phase), summary table printed last.
A phase is skipped (reported) once --budget-s wall seconds have passed.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cutlass_cases, also in spawned workers
from cutlass_cases import check_case, check_graph, check_merge_only, make_inputs, matrix_cases  # noqa: E402

import splitkv  # noqa: E402

os.environ.setdefault("SPLITKV_CACHE_DIR", "/tmp/splitkv-cutlass-cache")  # kept while the machine is warm
HERE = os.path.abspath(__file__)
RESULTS: dict = {"phases": {}}


def log(*a):
    print(*a, flush=True)


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
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for row, (kind, fields) in zip(rows, todo):
            t = time.perf_counter()
            try:
                cfg = _cfg(kind, fields)
                (launch.compile_split if kind == "split" else launch.compile_merge)(cfg, arch)
                row["load_s"] = round(time.perf_counter() - t, 2)
            except Exception as e:
                row.update(ok=False, error=f"load: {type(e).__name__}: {e}")
            if CACHE.stats["compiled"]:  # the disk load failed: the rest would compile serially here
                log("disk-cache load FAILED; the other variants compile on first use")
                break
    stats = dict(CACHE.stats)
    warned = [str(w.message)[:600] for w in caught]
    log(f"in-process: {stats} (disk = loaded from the disk cache, compiled = disk load failed) {warned}")
    return dict(rows=rows, cache_stats=stats, warnings=warned,
                ok=all(r["ok"] for r in rows) and stats["compiled"] == 0)


def _cfg(kind, fields):
    from splitkv.backends.cutlass.config import MergeConfig, SplitConfig

    return SplitConfig(*fields) if kind == "split" else MergeConfig(*fields)


def _warm_one(item, arch):
    kind, fields = item
    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.cache import CACHE

    cfg = _cfg(kind, fields)
    t = time.perf_counter()
    try:
        CACHE.get(cfg.name, arch, lambda: (launch.build_split if kind == "split" else launch.build_merge)(cfg))
        return cfg.name, round(time.perf_counter() - t, 2), True, None
    except Exception as e:
        return cfg.name, round(time.perf_counter() - t, 2), False, f"{type(e).__name__}: {str(e)[:300]}"


def _run_rows(items, fn):
    rows = []
    for item in items:
        try:
            r = {"name": item["name"], **fn(item)}
        except Exception as e:
            r = dict(name=item["name"], ok=False, error=f"{type(e).__name__}: {e}",
                     trace=traceback.format_exc()[-1500:])
        log(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['name']:40s} err_o={r.get('err_o', float('nan')):.2e} "
            f"err_lse={r.get('err_lse', float('nan')):.2e} {r.get('error', '')}")
        rows.append(r)
    return rows


def phase_correct(args):
    rows = _run_rows(matrix_cases(args.quick), check_case)
    for r in check_merge_only():
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


def _spawn(prefix, timeout, env=None):
    cmd = prefix + [sys.executable, HERE, "--child"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
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
        # no caching allocator: an out-of-bounds access then leaves its allocation and is caught
        r = _spawn(["compute-sanitizer", "--tool", tool, "--error-exitcode", "99"], 280,
                   env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
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


def _bench_shape(B, Hq, Hkv, L, page, backends_, split_cfg=None, direct=None):
    import triton

    D, dtype = 128, "bf16"
    kv_bytes = 2 * B * L * Hkv * D * 2
    copies = max(1, min(16, -(-240_000_000 // kv_bytes)))
    sets = [make_inputs(dtype, D, Hq, Hkv, 1, [L] * B, page, seed=i)[:5] for i in range(copies)]
    p = splitkv.plan(sets[0][3], Hq, Hkv, D, backend="cutlass", paged=page is not None)  # the direct A/B path
    plans = {"cutlass": p}

    def plan_of(be):  # a decode call runs the plan made for its backend and layout
        if be not in plans:
            plans[be] = splitkv.plan(sets[0][3], Hq, Hkv, D, backend=be, paged=page is not None)
        return plans[be]
    outs = [torch.empty_like(s[0]) for s in sets]
    row = dict(B=B, Hq=Hq, Hkv=Hkv, L=L, page=page, kv_mb=round(kv_bytes / 1e6, 1), splits=p.max_splits)
    for be in backends_:
        def call(i, be=be):
            q, k, v, sl, bt = sets[i]
            if direct is not None:  # name -> kwargs of _split_direct (A/B of kernel configs)
                kw = direct[be](p)  # built once, not inside the timed call
                return lambda: _split_direct(q, k, v, sl, bt, p, outs[i], **kw)
            if split_cfg is not None:
                return lambda: _split_direct(q, k, v, sl, bt, p, outs[i], split_cfg)
            pb = plan_of(be)
            return lambda: splitkv.decode(q, k, v, sl, block_table=bt, plan=pb, out=outs[i], backend=be)
        try:
            call(0)()
            eager = triton.testing.do_bench(call(0), warmup=25, rep=200, return_mode="median") * 1e3
            gr = graph_us(call, copies)
            row[be] = dict(eager_us=round(eager, 1), graph_us=round(gr, 1),
                           graph_tbps=round(kv_bytes / gr / 1e6, 2), eager_tbps=round(kv_bytes / eager / 1e6, 2))
        except Exception as e:
            row[be] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


def _split_direct(q, k, v, seqlens, bt, p, out, cfg, merge_cfg=None, merge=True, fuse=False):
    from splitkv.backends.cutlass import launch

    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    o_part, lse_part = p.partials()
    launch.split_(q, k, v, seqlens, bt, p, o_part, lse_part, out, lse, q.shape[-1] ** -0.5, True, cfg=cfg,
                  fuse=fuse)
    if o_part is not None and merge and not fuse:
        launch.merge_(o_part, lse_part, p.num_splits, out, lse, skip_single=True, cfg=merge_cfg)


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
    for B, Hq, Hkv, L in ((1, 32, 8, 32768), (16, 32, 32, 32768), (64, 32, 8, 32768)):
        for bn, st in ((64, 3), (128, 2), (128, 3)):  # split-plan tile vs the unsplit candidates
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


PDL_SHAPES = [(1, 32, 8, 4096), (1, 64, 8, 4096), (4, 32, 8, 4096), (1, 32, 32, 4096), (1, 32, 8, 32768),
              (1, 32, 8, 131072), (4, 32, 8, 32768)]


def phase_pdl(args):
    """Fused merge in the split kernel vs the merge kernel (heuristics.CUTLASS_FUSED_MERGE_MAX_SPLITS),
    programmatic dependent launch on/off (heuristics.CUTLASS_PDL), and the split kernel alone."""
    from splitkv.backends.cutlass.config import MergeConfig, split_config

    def variant(pdl, merge=True, fuse=False):
        return lambda p: dict(cfg=split_config("bfloat16", 128, p.tile.block_m, False, pdl),
                              merge_cfg=MergeConfig("float32", "bfloat16", 128, pdl), merge=merge, fuse=fuse)

    direct = {"fused": variant(True, fuse=True), "pdl": variant(True), "nopdl": variant(False),
              "split_only_pdl": variant(True, False)}
    rows = []
    shapes = PDL_SHAPES
    if os.environ.get("PDL_SHAPES"):  # e.g. "64,32,8,32768;1,32,8,4096"
        shapes = [tuple(int(x) for x in s.split(",")) for s in os.environ["PDL_SHAPES"].split(";")]
    for B, Hq, Hkv, L in shapes:
        r = _bench_shape(B, Hq, Hkv, L, None, tuple(direct), direct=direct)
        r.update(_bench_shape(B, Hq, Hkv, L, None, ("triton",)))
        torch.cuda.empty_cache()
        log(f"  pdl B{B} {Hq}/{Hkv} L{L} splits={r['splits']}: "
            + "  ".join(f"{k} {r[k].get('graph_us', r[k])}/{r[k].get('eager_us', '')}" for k in (*direct, "triton")))
        rows.append(r)
    return dict(rows=rows, ok=True)


PHASES = {"pdl": phase_pdl, "compile": phase_compile, "correct": phase_correct, "cache": phase_cache,
          "sanitize": phase_sanitize, "bench": phase_bench, "sweep": phase_sweep}


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
