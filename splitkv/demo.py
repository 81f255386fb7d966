"""`python -m splitkv demo`: a long-context decode per backend, checked against the reference.

GPU: B=1, Hq 32 / Hkv 8, D 128, bf16 at 32K and 128K keys, for every backend available (auto =
what `splitkv.decode` picks): the eager time a user gets calling `splitkv.decode(q, k, v, lens)`
with no plan, the CUDA-graph replay time of a graph-safe plan, and torch SDPA's cuDNN backend eager
and under graph replay, measured in the same run on the same inputs (splitkv.bench's timers: eager
= do_bench method, L2 flushed, median; graph = replays of captured calls over buffers > 256 MB).
CPU: the same head layout at sizes that finish in seconds (torch backend, eager only; the Triton
kernels interpreted at a small size when TRITON_INTERPRET=1).
Then a random-weight Llama decodes through PagedKVCache + splitkv (demo_llama.py).
"""

from __future__ import annotations

import os

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import splitkv
from splitkv import backends


def _cases(device):
    if device.type == "cuda":
        names = ["auto", "triton"] + (["cutlass"] if backends.cutlass_available() else [])
        return [(1, 32, 8, 128, L, torch.bfloat16, names) for L in (32768, 131072)]
    cases = [(1, 32, 8, 128, L, torch.bfloat16, ["torch"]) for L in (4096, 16384)]
    if os.environ.get("TRITON_INTERPRET") == "1" and backends.triton_available():
        cases.append((1, 8, 2, 64, 512, torch.bfloat16, ["triton"]))
    return cases


def _timed(row: dict | None, mode: str, unit: float) -> str:
    """'µs (bandwidth)' of a bench row in one mode (bandwidth in TB/s, / unit); the status or '—'
    when there is no time."""
    if row is None:
        return "—"
    if row["status"] != "ok":
        return row["status"]
    us, tbps = row[f"{mode}_us"], row[f"{mode}_tbps"]
    if us is None:
        return "—"
    return f"{us:,.1f} ({tbps / unit:,.2f})" if tbps is not None else f"{us:,.1f}"


def _row_ok(row: dict) -> bool:
    from .bench import report

    return row["status"] == "ok" and not report.err_flag(row)


def _splits(sl, Hq, Hkv, D, name) -> str:
    """Split count decode plans for this problem (read outside every timed region)."""
    try:
        if name == "torch":  # on the CPU one fused pass per request: the plan's split table is not used
            return "1 (CPU)"
        p = splitkv.plan(sl, Hq, Hkv, D, backend=name)
        return str(max(int(n) for n in p.num_splits.tolist()))
    except Exception:  # noqa: BLE001 - display only
        return "?"


def _unit(device) -> tuple[str, float]:
    """Bandwidth unit of the table: TB/s on a GPU, GB/s on the CPU (TB/s would print 0.00)."""
    return ("TB/s", 1.0) if device.type == "cuda" else ("GB/s", 1e-3)


def measure_case(B, Hq, Hkv, D, L, dtype, names, device) -> tuple[list[list[str]], bool, list[str]]:
    """Table rows for one problem (one per backend), whether every splitkv result matched the
    reference, and notes (errors) to print under the table."""
    from .bench import check, inputs, report, runner, shapes
    from .bench.providers import SDPA, SplitKV

    gpu = device.type == "cuda"
    shape = shapes.make_shape(B, L, Hq, Hkv, D)
    case = inputs.build_case(shape, dtype, device, seed=0)
    ref = check.build_reference(case)
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    # eager reps: ~30 ms per measurement on a GPU; on the CPU a couple (the CPU demo takes seconds)
    cfg = runner.Config(device=device, suite="demo", reps=20 if gpu else 2, graph=gpu, host=False)
    cfg_eager = runner.Config(device=device, suite="demo", reps=cfg.reps, graph=False, host=False)
    cudnn = None
    if gpu and SDPA("cudnn").unavailable() is None:
        cudnn = runner.measure(case, ref, SDPA("cudnn"), cfg, dname)
    rows, ok, notes = [], True, []
    unit = _unit(device)[1]
    for name in names:
        eager = runner.measure(case, ref, SplitKV(name, noplan=True), cfg_eager, dname)
        graph = runner.measure(case, ref, SplitKV(name), cfg, dname) if gpu else None
        mine = [r for r in (eager, graph) if r is not None]
        report.finalize(mine + ([cudnn] if cudnn is not None else []), report.SOL_TBPS)
        good = all(_row_ok(r) for r in mine) and (graph is None or graph["graph_us"] is not None)
        ok &= good
        errs = [e for r in mine for e in (r["max_abs_err"], r["graph_max_abs_err"]) if e is not None]
        err = "nan" if any(e != e for e in errs) else (f"{max(errs):.1e}" if errs else "—")
        for r in mine:
            note = r["note"] or ""
            if r["status"] != "ok" or note.startswith("graph: ") or "; graph: " in note:  # a failed capture
                notes.append(f"{name} ({r['provider']}, {L} keys): {r['status']}: {r['note']}")
        rows.append([name, str(B), f"{Hq}/{Hkv}", str(D), str(L), _splits(case.base.cache_seqlens, Hq, Hkv, D, name),
                     _timed(eager, "eager", unit), _timed(graph, "graph", unit), _timed(cudnn, "eager", unit),
                     _timed(cudnn, "graph", unit),
                     err, "[green]ok[/]" if good else "[red]FAIL[/]"])
    if cudnn is not None and cudnn["status"] != "ok":
        notes.append(f"sdpa-cudnn ({L} keys): {cudnn['status']}: {cudnn['note']}")
    case.release()
    return rows, ok, notes


def main(argv: list[str] | None = None) -> int:
    from .cli_args import demo_parser

    args = demo_parser().parse_args(argv)
    console = Console(width=None if Console().is_terminal else 160)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    console.print(f"[bold]splitkv {splitkv.__version__}[/] demo on {where}: single-token decode, "
                  "bf16, every result checked against splitkv.reference (fp64)")
    bw = _unit(device)[0]
    table = Table("backend", "B", "Hq/Hkv", "D", "keys", "splits", f"eager, no plan µs ({bw})",
                  f"graph, plan µs ({bw})", f"cuDNN eager µs ({bw})", f"cuDNN graph µs ({bw})", "max |err|", "check")
    ok_all, notes = True, []
    for B, Hq, Hkv, D, L, dt, names in _cases(device):
        rows, ok, case_notes = measure_case(B, Hq, Hkv, D, L, dt, names, device)
        for r in rows:
            table.add_row(*r)
        ok_all &= ok
        notes += case_notes
    console.print(table)
    for n in notes:
        console.print(escape(n), highlight=False)
    if device.type == "cuda":
        console.print("eager, no plan: `splitkv.decode(q, k, v, lens, backend=...)` as a new user calls it "
                      "(median, L2 flushed); graph: CUDA-graph replay of decode with a graph-safe plan "
                      "(`splitkv.plan(..., max_seqlen=L)`), per call; cuDNN: torch SDPA's cuDNN backend on "
                      "the same inputs, same run. TB/s = (K + V + q + o bytes) / time. "
                      "Full suite: `python -m splitkv bench`.")
    else:
        console.print("No GPU here: the CPU runs the torch backend (one fused attention pass per request, "
                      "ATen's CPU flash kernel; the split/merge spec runs when partials are asked for), eager, "
                      "no plan. On a CUDA GPU the demo times the Triton (and CUTLASS) kernels at 32K and 128K "
                      "keys, eager and under CUDA-graph replay, next to cuDNN.")
    console.print("[green]all results match the reference[/]" if ok_all else "[red]mismatch against the reference[/]")
    from .demo_llama import run as run_llama

    ok_all &= run_llama(console, device, tf_compile=args.tf_compile)
    return 0 if ok_all else 1
