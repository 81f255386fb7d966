"""`python -m splitkv compile --backend cutlass --arch sm_90a`: compile every kernel variant the
CuTe DSL backend can launch, without a GPU, and print registers / spills per variant (ptxas -v on
the generated PTX). CI runs it so that a DSL upgrade or a kernel edit that breaks compilation is
caught on a CPU machine. Exit status 1 when any variant fails to compile (or, with
--fail-on-spill, spills).

Filters restrict the build to what a model uses (default: every variant): --head-dims, --dtypes,
--layouts, and the query tile, which the planner derives from Hq/Hkv x Sq (--heads 32/8 or
--group-sizes 4, with --q-lens). --warmup instead runs splitkv.warmup on this machine's GPU for
those shapes (the real first-call compiles, which also fill the kernel disk caches) and prints the
time per combination.

Do not set CUTE_DSL_ARCH on a machine without a GPU: the DSL would try to start the driver.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from .constants import BACKEND_CHOICES, HEAD_DIMS, MAX_Q_LEN
from .constants import LOW_DTYPE_NAMES as DTYPES

# SplitConfig's variant flags, and what --warmup passes decode for each (the kernels depend on the
# option's presence, not its value)
VARIANT_KWARGS = {"softcap": ("softcap", 30.0), "alibi": ("alibi_slopes", True), "window": ("window_size", (1024, -1))}
VARIANT_MODS = tuple(VARIANT_KWARGS)

_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def find_ptxas() -> str | None:
    for cand in (shutil.which("ptxas"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")):
        if cand and os.path.exists(cand):
            return cand
    return None


def ptxas_info(ptx_path: str, arch: str, ptxas: str | None) -> dict:
    """Registers / spills / stack of the (largest) kernel in a PTX file."""
    if ptxas is None:
        return {"ptxas": "not found"}
    clean = ptx_path + ".clean.ptx"
    with open(ptx_path, "rb") as f, open(clean, "wb") as g:
        g.write(f.read().replace(b"\0", b""))  # the DSL's PTX ends in a NUL that ptxas rejects
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", clean, "-o", os.devnull], capture_output=True, text=True)
    if r.returncode:
        return {"ptxas": "failed: " + r.stderr.strip()[-300:]}
    out = {}
    for key, rx in _PTXAS_RE.items():
        vals = [int(v) for v in rx.findall(r.stderr)]
        out[key] = max(vals) if vals else 0
    return out


def _compile_one(kind: str, fields: tuple, arch: str, dump_root: str) -> dict:
    """Worker: compile one variant into its own dump directory, then ptxas -v its PTX."""
    import cutlass.cute as cute

    from splitkv.backends.cutlass import launch
    from splitkv.backends.cutlass.cache import compile_options
    from splitkv.backends.cutlass.config import MergeConfig, SplitConfig

    cfg = SplitConfig(*fields) if kind == "split" else MergeConfig(*fields)
    build = launch.build_split if kind == "split" else launch.build_merge
    dump = os.path.join(dump_root, cfg.name)
    os.makedirs(dump, exist_ok=True)
    row = {"name": cfg.name, "kind": kind}
    if kind == "split":
        row["smem_bytes"] = cfg.smem_bytes
    t0 = time.perf_counter()
    try:
        kernel, args = build(cfg)
        cute.compile(kernel, *args, options=compile_options(arch, dump))
    except Exception as e:  # report and go on: one broken variant must not hide the others
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).strip()[:400]}")
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    ptx = [os.path.join(dump, f) for f in os.listdir(dump) if f.endswith(".ptx") and not f.endswith(".clean.ptx")]
    row.update(ok=True, **(ptxas_info(ptx[0], arch, find_ptxas()) if ptx else {"ptxas": "no PTX dumped"}))
    return row


def variants(only: str | None = None, *, head_dims=None, dtypes=None, group_sizes=None, q_lens=None,
             layouts=None, mods=None, kv_formats=None) -> list[tuple[str, tuple]]:
    """(kind, config fields) of the CuTe DSL variants to compile; each filter None = no restriction.

    head_dims: ints; dtypes: names ("bfloat16", "float16"); layouts: "dense" / "paged" (split
    kernels). group_sizes (Hq / Hkv) and q_lens select split kernels by the query tile the planner
    gives them (heuristics.tile_config: block_m from group size x Sq); give group_sizes to use
    q_lens (q_lens default (1,)). Merge kernels are kept for the head dims and output dtypes
    asked, with float32 partials (decode's) and partials in those dtypes (merge_states').
    mods: attention-variant options compiled into the split kernels ("softcap", "alibi", "window";
    default none: plain kernels; sinks need no kernel of their own). kv_formats: the caches' dtypes
    as "bf16" (fp16/bf16 caches), "e4m3", "e5m2" (fp8 caches).
    """
    from dataclasses import astuple, replace

    from splitkv import heuristics as H
    from splitkv.backends.cutlass.config import merge_variants, split_variants

    if q_lens is not None and group_sizes is None:
        raise ValueError("q_lens: the query tile depends on group size x Sq; give group_sizes (or --heads) too")
    tiles = None
    if group_sizes is not None:
        tiles = {(d, H.tile_config(d, g * s).block_m) for d in HEAD_DIMS for g in group_sizes
                 for s in (q_lens or (1,))}
    splits = [c for c in split_variants()
              if (head_dims is None or c.head_dim in head_dims) and (dtypes is None or c.dtype in dtypes)
              and (layouts is None or ("paged" if c.paged else "dense") in layouts)
              and (tiles is None or (c.head_dim, c.block_m) in tiles)
              and (kv_formats is None or (c.kv_fp8 or "bf16") in kv_formats)]
    merges = [c for c in merge_variants()
                if (head_dims is None or c.head_dim in head_dims)
                and (dtypes is None or (c.out_dtype in dtypes and c.part_dtype in ("float32", *dtypes)))]
    if mods:  # fp8 kernels take the window, not softcap / ALiBi (SplitConfig)
        splits = [replace(c, **{m: True for m in mods}) for c in splits
                  if not (c.kv_fp8 and {"softcap", "alibi"} & set(mods))]
    out = [("split", astuple(c)) for c in splits] + [("merge", astuple(c)) for c in merges]
    if only:
        rx = re.compile(only)
        out = [(k, f) for k, f in out if rx.search(_name(k, f))]
    return out


def _name(kind, fields):
    from splitkv.backends.cutlass.config import MergeConfig, SplitConfig

    return (SplitConfig(*fields) if kind == "split" else MergeConfig(*fields)).name


def _print_table(rows: list[dict], arch: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in rows:
            print(json.dumps(r))
        return
    t = Table(title=f"splitkv cutlass kernels for {arch}")
    for col in ("variant", "ok", "regs", "spill st/ld (B)", "stack (B)", "smem (B)", "compile (s)"):
        t.add_column(col)
    for r in rows:
        if not r["ok"]:
            t.add_row(r["name"], "[red]FAIL", r["error"], "", "", "", "")
            continue
        regs = str(r.get("registers", r.get("ptxas", "?")))
        spills = f"{r.get('spill_stores', '?')}/{r.get('spill_loads', '?')}"
        t.add_row(r["name"], "ok", regs, spills, str(r.get("stack", "?")), str(r.get("smem_bytes", "")),
                  str(r.get("compile_s", "")))
    Console(width=160).print(t)


def _list(kind, allowed=None):
    """argparse type: comma-separated values of `kind`, each in `allowed` when given."""
    def parse(text: str):
        try:
            vals = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from e
        bad = [v for v in vals if allowed is not None and v not in allowed]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} not in {allowed}")
        return vals
    return parse


def _heads(text: str) -> tuple[tuple[int, int], ...]:
    """argparse type: '32/8,64/8' -> ((32, 8), (64, 8))."""
    out = []
    for item in text.split(","):
        try:
            hq, hkv = (int(x) for x in item.split("/"))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected Hq/Hkv pairs like 32/8,64/8, got {item!r}") from e
        if hq < 1 or hkv < 1 or hq % hkv:
            raise argparse.ArgumentTypeError(f"{item!r}: Hq must be a positive multiple of Hkv")
        out.append((hq, hkv))
    return tuple(out)


def _run_warmup(args) -> int:
    import torch

    from splitkv.warmup import describe, warmup

    kw = {}
    if args.head_dims:
        kw["head_dims"] = args.head_dims
    if args.dtypes:
        kw["dtypes"] = args.dtypes
    if args.heads:
        kw["num_q_heads"] = tuple(h for h, _ in args.heads)
        kw["num_kv_heads"] = tuple(h for _, h in args.heads)
    if args.q_lens:
        kw["q_lens"] = args.q_lens
    if args.layouts:
        kw["paged"] = tuple(lay == "paged" for lay in args.layouts)
    if args.variants:  # plain, and the variants together (the kernels compile them in as one config)
        kw["variants"] = ({}, {VARIANT_KWARGS[m][0]: VARIANT_KWARGS[m][1] for m in args.variants})
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: warming the torch backend on the CPU (nothing to compile)", file=sys.stderr)
    try:
        res = warmup(**kw, page_size=args.page_size, backends=args.backend or ("auto",), device=args.device,
                     verbose=args.verbose)
    except ValueError as e:
        print(f"warmup: {e}", file=sys.stderr)
        return 2
    if not args.verbose:  # verbose: the progress display printed them already
        for row in res["combinations"]:
            print(f"{describe(row):64s} {row['seconds']:8.2f} s")
    print(f"{len(res['combinations'])} combination(s) warmed on {res['device']} in {res['total_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitkv compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None, type=_list(str, BACKEND_CHOICES),
                    help="compile: only 'cutlass' (the default) compiles ahead of time; "
                         "--warmup: backends to warm, comma-separated (default auto)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--only", default=None, help="regex on variant names (e.g. 'd128.*m16')")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--dump-dir", default=None, help="keep the PTX here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    ap.add_argument("--fail-on-spill", action="store_true")
    flt = ap.add_argument_group("filters (default: every variant; with --warmup: splitkv.warmup's defaults)")
    flt.add_argument("--head-dims", type=_list(int, HEAD_DIMS), help="e.g. 128,256")
    flt.add_argument("--dtypes", type=_list(str, DTYPES), help="e.g. bfloat16")
    flt.add_argument("--heads", type=_heads, help="Hq/Hkv pairs of the model, e.g. 32/8,64/8")
    flt.add_argument("--group-sizes", type=_list(int, range(1, 257)),
                     help="Hq/Hkv, e.g. 4,8 (instead of --heads; compile only)")
    flt.add_argument("--q-lens", type=_list(int, tuple(range(1, MAX_Q_LEN + 1))),
                   help="query tokens per decode (Sq; > 1 for speculative verify), e.g. 1,4 (default 1)")
    flt.add_argument("--layouts", type=_list(str, ("dense", "paged")), help="KV cache layouts: dense,paged")
    flt.add_argument("--kv-formats", type=_list(str, ("bf16", "e4m3", "e5m2")),
                     help="KV cache dtypes: bf16 (fp16/bf16 caches), e4m3, e5m2 (fp8 caches; compile only)")
    flt.add_argument("--variants", type=_list(str, VARIANT_MODS),
                     help="attention variants compiled into the split kernels, e.g. softcap,alibi,window "
                          "(default: plain kernels; --warmup warms plain and these together)")
    w = ap.add_argument_group("warm-up on a GPU")
    w.add_argument("--warmup", action="store_true",
                   help="run splitkv.warmup (real first calls on this machine's GPU) instead of compiling")
    w.add_argument("--device", default="cuda")
    w.add_argument("--page-size", type=int, default=16, help="page size of the paged layout")
    w.add_argument("-v", "--verbose", action="store_true", help="progress display")
    args = ap.parse_args(argv)
    if args.only is not None:
        try:
            re.compile(args.only)
        except re.error as e:
            ap.error(f"--only: not a regular expression ({e}): {args.only!r}")
    if not re.fullmatch(r"sm_\d+a?", args.arch):
        ap.error(f"--arch: expected sm_<NN>[a], e.g. sm_90a, got {args.arch!r}")
    if args.warmup:
        if args.group_sizes:
            ap.error("--warmup needs --heads Hq/Hkv (the kernels specialise on both), not --group-sizes")
        return _run_warmup(args)
    backend = args.backend or ("cutlass",)
    if backend != ("cutlass",):
        print(f"backend {','.join(backend)!r}: nothing to compile ahead of time (only 'cutlass'; "
              "--warmup warms the others on a GPU)", file=sys.stderr)
        return 2
    group_sizes = args.group_sizes or (tuple(hq // hkv for hq, hkv in args.heads) if args.heads else None)
    if args.q_lens and group_sizes is None:
        ap.error("--q-lens needs --heads or --group-sizes (the query tile is Hq/Hkv x Sq rows)")
    from splitkv.backends.cutlass import INSTALL_HINT, available

    if not available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    todo = variants(args.only, head_dims=args.head_dims, dtypes=args.dtypes, group_sizes=group_sizes,
                    q_lens=args.q_lens, layouts=args.layouts, mods=args.variants, kv_formats=args.kv_formats)
    if not todo:
        print("no variant matches the filters (--only / --head-dims / --dtypes / --heads / --group-sizes / "
              "--q-lens / --layouts)", file=sys.stderr)
        return 2
    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="splitkv-compile-")
    t0 = time.perf_counter()
    if args.jobs <= 1:
        rows = [_compile_one(k, f, args.arch, dump_root) for k, f in todo]
    else:  # spawn: the DSL and torch do not survive fork well, and compiles are CPU-bound
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as ex:
            rows = list(ex.map(_compile_one, *zip(*[(k, f, args.arch, dump_root) for k, f in todo])))
    _print_table(rows, args.arch)
    failed = [r["name"] for r in rows if not r["ok"]]
    spilled = [r["name"] for r in rows if r["ok"] and (r.get("spill_stores") or r.get("spill_loads"))]
    print(f"{len(rows) - len(failed)}/{len(rows)} variants compiled for {args.arch} in "
          f"{time.perf_counter() - t0:.0f} s; {len(spilled)} spill; PTX under {dump_root}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "rows": rows}, f, indent=1)
    if failed:
        print("FAILED: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 1 if (args.fail_on_spill and spilled) else 0


if __name__ == "__main__":
    sys.exit(main())
