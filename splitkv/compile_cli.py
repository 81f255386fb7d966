"""`python -m splitkv compile --backend cutlass --arch sm_90a`: compile every kernel variant the
CuTe DSL backend can launch, without a GPU, and print registers / spills per variant (ptxas -v on
the generated PTX). CI runs it so that a DSL upgrade or a kernel edit that breaks compilation is
caught on a CPU machine. Exit status 1 when any variant fails to compile (or, with
--fail-on-spill, spills).

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
    from splitkv.backends.cutlass.config import CombineConfig, SplitConfig

    cfg = SplitConfig(*fields) if kind == "split" else CombineConfig(*fields)
    build = launch.build_split if kind == "split" else launch.build_combine
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


def variants(only: str | None = None) -> list[tuple[str, tuple]]:
    from dataclasses import astuple

    from splitkv.backends.cutlass.config import combine_variants, split_variants

    out = [("split", astuple(c)) for c in split_variants()] + [("combine", astuple(c)) for c in combine_variants()]
    if only:
        rx = re.compile(only)
        out = [(k, f) for k, f in out if rx.search(_name(k, f))]
    return out


def _name(kind, fields):
    from splitkv.backends.cutlass.config import CombineConfig, SplitConfig

    return (SplitConfig(*fields) if kind == "split" else CombineConfig(*fields)).name


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitkv compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cutlass", help="only 'cutlass' compiles ahead of time")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--only", default=None, help="regex on variant names (e.g. 'd128.*m16')")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--dump-dir", default=None, help="keep the PTX here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    ap.add_argument("--fail-on-spill", action="store_true")
    args = ap.parse_args(argv)
    if args.backend != "cutlass":
        print(f"backend {args.backend!r}: nothing to compile ahead of time (only 'cutlass')", file=sys.stderr)
        return 2
    from splitkv.backends.cutlass import INSTALL_HINT, available

    if not available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    todo = variants(args.only)
    if not todo:
        print(f"no variant matches --only {args.only!r}", file=sys.stderr)
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
