"""Rows, derived columns and outputs: the rich terminal table, JSON and markdown.

FIELDS is the row schema (documented with units in splitkv/bench/__init__.py; tests hold the two
together). JSON: {"schema", "meta", "skipped_providers", "rows", "sweep"}.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

SCHEMA = "splitkv.bench/1"
SOL_TBPS = 4.8  # H200 HBM3e spec bandwidth (PEERS.md); --sol-tbps for other GPUs
# Spec DRAM bandwidth, TB/s, of the GPUs a device name is matched against (first match wins). Any
# other device (a CPU included) has no speed of light: % of SOL stays null unless --sol-tbps gives one.
DEVICE_SOL_TBPS = (
    (r"\bH200\b", SOL_TBPS),
    (r"\bH100 NVL\b", 3.9),
    (r"\bH100 PCIe\b", 2.0),
    (r"\bH100\b", 3.35),  # SXM (HBM3)
    (r"\bA100\b.*80GB.*PCIe", 1.935),
    (r"\bA100\b.*80GB", 2.039),
    (r"\bA100\b", 1.555),  # 40GB
)
ERR_WARN = 2e-2  # rel_err above this is flagged in the table (bf16 rows are ~1e-3)

FIELDS = (
    "shape", "provider", "kind", "status", "note", "dtype", "batch", "num_q_heads", "num_kv_heads",
    "head_dim", "q_len", "causal", "page_size", "seqlen_max", "seqlen_total", "bytes",
    "eager_us", "eager_reps", "graph_us", "graph_calls", "graph_replays", "graph_captures_us", "host_us", "host_calls",
    "eager_tbps", "graph_tbps", "eager_pct_sol", "graph_pct_sol",
    "eager_vs_best_peer", "graph_vs_best_peer", "best_peer_eager", "best_peer_graph",
    "max_abs_err", "rel_err", "graph_max_abs_err", "graph_rel_err", "err_scope", "plan", "graph_plan",
    "cmd",
)


def err_flag(r: dict) -> bool:
    """True when the eager or the graph output is off the reference by more than ERR_WARN (or NaN)."""
    return any(r[k] is not None and not r[k] <= ERR_WARN for k in ("rel_err", "graph_rel_err"))


def _max_err(r: dict):
    errs = [r[k] for k in ("max_abs_err", "graph_max_abs_err") if r[k] is not None]
    if any(e != e for e in errs):
        return float("nan")
    return max(errs) if errs else None


def new_row(shape, provider, dtype_name: str, elem_bytes: int, cmd: str) -> dict:
    row = dict.fromkeys(FIELDS)
    row.update(shape=shape.name, provider=provider.name, kind=provider.kind, status="ok", note="",
               dtype=dtype_name, batch=shape.batch, num_q_heads=shape.num_q_heads,
               num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, q_len=shape.q_len,
               causal=shape.causal, page_size=shape.page_size, seqlen_max=shape.max_seqlen,
               seqlen_total=sum(shape.seqlens), bytes=shape.bytes(elem_bytes), cmd=cmd)
    return row


def device_sol_tbps(device) -> float | None:
    """Speed of light (spec DRAM bandwidth, TB/s) of the GPU `device` is, or None: a CPU, or a GPU
    not in DEVICE_SOL_TBPS."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tbps for pattern, tbps in DEVICE_SOL_TBPS if re.search(pattern, name)), None)


def finalize(rows: list[dict], sol_tbps: float | None) -> None:
    """Fill bandwidth, % of SOL (null when sol_tbps is None) and the ratio vs the best peer of the
    same shape and dtype."""
    for r in rows:
        for mode in ("eager", "graph"):
            us = r[f"{mode}_us"]
            tbps = r["bytes"] / us / 1e6 if us else None
            r[f"{mode}_tbps"] = tbps
            r[f"{mode}_pct_sol"] = 100.0 * tbps / sol_tbps if tbps and sol_tbps else None
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["dtype"]), []).append(r)
    for group in groups.values():
        for mode in ("eager", "graph"):
            peers = [r for r in group if r["kind"] == "peer" and r[f"{mode}_us"]]
            best = min(peers, key=lambda r: r[f"{mode}_us"]) if peers else None
            for r in group:
                if best is not None and r[f"{mode}_us"]:
                    r[f"{mode}_vs_best_peer"] = best[f"{mode}_us"] / r[f"{mode}_us"]
                    r[f"best_peer_{mode}"] = best["provider"]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def collect_meta(device: torch.device, argv: list[str], sol_tbps: float | None, flush: str = "write") -> dict:
    from .. import __version__

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu", "num_sms": None, "driver": None, "cuda": torch.version.cuda, "cudnn": None,
        "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
        "cutlass": _version("nvidia-cutlass-dsl"), "flashinfer": _version("flashinfer-python"),
        "flash_attn": _version("flash-attn"), "splitkv": __version__,
        # SPLITKV_TREE names the tree where the copy that runs has no git history of its own (a
        # device machine: what git finds there may be another checkout's)
        "git_commit": os.environ.get("SPLITKV_TREE") or _run(["git", "-C", str(Path(__file__).resolve().parents[2]),
                                                              "rev-parse", "--short", "HEAD"]),
        "sol_tbps": sol_tbps, "command": "python -m splitkv bench " + " ".join(argv),
        "timing": (("eager: median of L2-flushed reps (do_bench method)" if flush == "write" else
                    "eager: median of reps with the L2 evicted by a 256 MB read (--flush read: clean lines, so the "
                    "call pays no write-back of a memset's dirty lines)")
                   + "; splitkv-<backend> rows reuse a "
                   "plan made outside the timed region, splitkv-<backend>-noplan rows call decode(q, k, v, "
                   "lens) with no plan (graph rows capture that call); graph: CUDA graph of N calls over "
                   "rotating buffers > 256 MB, per call, the faster of 2 captures; host: CPU time per call "
                   "of N calls issued back to back without synchronising (median of 3 loops)"),
        "byte_model": "K+V of valid positions + q + o (splitkv.bench.shapes.byte_model)",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(device=props.name, num_sms=props.multi_processor_count,
                    driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                    cudnn=torch.backends.cudnn.version())
    else:
        meta["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return meta


def _finite(x):
    """Strict JSON has no NaN/inf: non-finite floats become null (rows say 'NaN in output' in note)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def write_json(path, meta: dict, skipped, rows: list[dict], sweep: list[dict] | None = None) -> None:
    doc = {"schema": SCHEMA, "meta": meta,
           "skipped_providers": [{"provider": n, "reason": r} for n, r in skipped],
           "rows": rows, "sweep": sweep or []}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(doc), indent=1, allow_nan=False))


def _f(x, fmt: str, empty: str = "—") -> str:
    return empty if x is None else format(x, fmt)


def headline_mode(rows: list[dict]) -> str:
    return "graph" if any(r["graph_us"] for r in rows) else "eager"


# markdown table columns after shape / dtype / provider (the terminal table has its own: TERM_*)
COLUMNS = ("eager µs", "eager TB/s", "eager × best peer", "graph µs", "graph TB/s", "graph × best peer",
           "host µs/call", "max err")


def _tbps(x) -> str:
    """TB/s with two decimals; below 0.1 TB/s (a CPU) three significant digits instead of 0.00."""
    if x is None:
        return "—"
    return format(x, ".2f") if x >= 0.1 or x == 0 else format(x, ".3g")


def _err_cell(r: dict) -> str:
    worst = _max_err(r)
    return "nan" if worst != worst else _f(worst, ".1e")


def _cells(r: dict) -> list[str]:
    if r["status"] != "ok":
        return [r["status"]] + ["—"] * (len(COLUMNS) - 1)
    return [_f(r["eager_us"], ".1f"), _tbps(r["eager_tbps"]), _f(r["eager_vs_best_peer"], ".2f"),
            _f(r["graph_us"], ".1f"), _tbps(r["graph_tbps"]), _f(r["graph_vs_best_peer"], ".2f"),
            _f(r["host_us"], ".1f"), _err_cell(r)]


def sol_text(sol_tbps: float | None) -> str:
    if sol_tbps is None:
        return ("no SOL: no known peak bandwidth for this device (--sol-tbps sets one; % of SOL stays "
                "null in the JSON)")
    return f"SOL = {sol_tbps:g} TB/s (% of SOL in the JSON)"


def write_markdown(path, meta: dict, skipped, rows: list[dict], sweep: list[dict] | None = None) -> None:
    lines = [f"# splitkv bench — {meta['device']}", "",
             f"{meta['date']} · driver {meta['driver']} · CUDA {meta['cuda']} · torch {meta['torch']} · "
             f"triton {meta['triton']} · cutlass-dsl {meta['cutlass']} · flashinfer {meta['flashinfer']} · "
             f"splitkv {meta['splitkv']} ({meta['git_commit']})", "",
             f"Command: `{meta['command']}`", "", f"Timing: {meta['timing']}.", "",
             f"Bytes: {meta['byte_model']}; {sol_text(meta['sol_tbps'])}. "
             "'× best peer' = the best peer's µs / this row's µs in the same mode (eager or graph), same "
             "shape and dtype; > 1 = faster. splitkv-<backend>-noplan is `splitkv.decode(q, k, v, lens)` "
             "with no plan (what a new user calls), eager and captured as it is; splitkv-<backend> reuses "
             "one plan (eager) or a graph-safe plan (graph). host µs/call: CPU time to issue one call (a call that reads "
             "lengths on the host pays the GPU time there too).", ""]
    if skipped:
        lines += ["Skipped providers: " + "; ".join(f"{n} ({r})" for n, r in skipped), ""]
    head = ("shape", "dtype", "provider") + COLUMNS + ("note", "reproduce")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = r["note"] + (f" (err over {r['err_scope']})" if r["err_scope"] not in (None, "all") else "")
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['provider']} | " + " | ".join(_cells(r))
                     + f" | {note.replace('|', '/')} | `{r['cmd']}` |")
    splits = [s for s in sweep or () if s.get("sweep") != "tiles"]
    tiles = [s for s in sweep or () if s.get("sweep") == "tiles"]
    if splits:
        lines += ["", "## num_splits sweep (the planner's report card)", "",
                  "| shape | mode | planner splits | planner µs | best splits | best µs | regret % | reproduce |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in splits:
            lines.append(f"| {s['shape']} | {s['mode']} | {s['planner_splits']} | "
                         f"{_f(s['planner_us'], '.1f')} | {s['best_splits']} | {_f(s['best_us'], '.1f')} | "
                         f"{_f(s['regret_pct'], '.1f')} | `{s['cmd']}` |")
    if tiles:
        lines += ["", "## Tile sweep (block_n x warps x stages; the planner's tile vs each forced one)", "",
                  "| shape | backend | mode | planner tile | planner µs | best tile | best µs | regret % | "
                  "every tile (µs) | reproduce |", "|---|---|---|---|---|---|---|---|---|---|"]
        for s in tiles:
            every = ", ".join(f"{c['tile']} {_f(c['us'], '.1f')}" if "us" in c else f"{c['tile']} error"
                              for c in s["curve"])
            lines.append(f"| {s['shape']} | {s['backend']} | {s['mode']} | {s['planner_tile']} | "
                         f"{_f(s['planner_us'], '.1f')} | {s['best_tile']} | {_f(s['best_us'], '.1f')} | "
                         f"{_f(s['regret_pct'], '.1f')} | {every} | `{s['cmd']}` |")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def gbps(tbps) -> str:
    """Bandwidth in GB/s, digits that read right from a CPU (0.27) to an H200 (4,512)."""
    if tbps is None:
        return "—"
    x = tbps * 1e3
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 0.01 or x == 0 else "<0.01"


def vs_peer(r: dict, mode: str) -> str:
    """'1.31× faster' / '5.88× slower' than the best peer; 'best peer' on that peer's own row."""
    ratio = r[f"{mode}_vs_best_peer"]
    if ratio is None or r["status"] != "ok":
        return "—"
    if r["provider"] == r[f"best_peer_{mode}"]:
        return "best peer"
    x, word = (ratio, "faster") if ratio >= 1 else (1 / ratio, "slower")
    return f"{x:.2f}× {word}" if x < 10 else f"{x:,.0f}× {word}"


def print_table(console, rows: list[dict], skipped, explain: bool = False, *, device: str | None = None,
                sol_tbps: float | None = None, wide: bool = False) -> None:
    """The terminal table: about 120 columns on a CPU, about 160 with the graph columns of a GPU run.
    Graph columns only when a row has graph times, % of SOL only with a SOL; wide adds dtype (also
    shown when the run has several), the graph columns and each row's note (always in --json /
    --markdown, with each row's reproduce command)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    graph = wide or any(r["graph_us"] for r in rows)
    dtype = wide or len({r["dtype"] for r in rows}) > 1
    modes = ("eager", "graph") if graph else ("eager",)
    cols: list[tuple[str, str]] = [("shape", "left")] + ([("dtype", "left")] if dtype else []) + [("provider", "left")]
    for mode in modes:
        cols += [(f"{mode} µs", "right"), ("GB/s", "right")]
        if sol_tbps:
            cols.append(("%SOL", "right"))
        cols.append(("vs best peer", "right"))
    cols += [("host µs", "right"), ("max err", "right")] + ([("note", "left")] if wide else [])
    title = f"splitkv bench{f' on {device}' if device else ''}"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_lines=False)
    for name, justify in cols:
        table.add_column(name, justify=justify, overflow="fold")
    last = None
    for r in rows:
        ok = r["status"] == "ok"
        cells = []
        for mode in modes:
            us = r[f"{mode}_us"]
            cells += [_f(us, ".1f") if ok else r["status"], gbps(r[f"{mode}_tbps"])]
            if sol_tbps:
                pct = r[f"{mode}_pct_sol"]
                cells.append(_f(pct, ".0f" if pct is not None and pct >= 10 else ".1f"))
            ratio = r[f"{mode}_vs_best_peer"]
            cell = vs_peer(r, mode)
            if r["kind"] == "splitkv" and ratio is not None and ok:
                cell = f"[{'green' if ratio >= 1 else 'red'}]{cell}[/]"
            cells.append(cell)
        err = _err_cell(r) if ok else "—"
        cells += [_f(r["host_us"], ".1f") if ok else "—", f"[red]{err}[/]" if err_flag(r) else err]
        if wide:
            cells.append(escape(r["note"] or ""))
        name = r["shape"] if r["shape"] != last else ""
        last = r["shape"]
        prov = f"[bold]{r['provider']}[/]" if r["kind"] == "splitkv" else r["provider"]
        table.add_row(name, *([r["dtype"]] if dtype else []), prov, *cells)
    console.print(table)
    if not wide:  # why a row is n/a or failed, once per distinct reason
        reasons: dict[tuple, list[str]] = {}
        for r in rows:
            if r["status"] != "ok":
                reasons.setdefault((r["provider"], r["status"], r["note"]), []).append(r["shape"])
        for (prov, status, note), names in reasons.items():
            console.print(f"{status}: {escape(prov)} on {', '.join(names)}: {escape(note or '')}", highlight=False)
    console.print("vs best peer: against the fastest peer (SDPA, FlashInfer, ...) on the same shape, dtype and "
                  "mode. GB/s: bytes a decode must move (K + V of the valid keys, q, o) / time. host µs: CPU "
                  "time to issue one call. "
                  + (f"%SOL: of {sol_tbps:g} TB/s." if sol_tbps else
                     "No %SOL: no known peak bandwidth for this device (--sol-tbps sets one)."),
                  highlight=False)
    if any(r["kind"] == "splitkv" and r["provider"].startswith("splitkv-torch") for r in rows):
        console.print("splitkv-torch is the plain-PyTorch backend (the CPU path and the readable spec of the "
                      "GPU kernels), not a tuned kernel; CPU times say nothing about a GPU.", highlight=False)
    if skipped:
        console.print("skipped (not available here): " + "; ".join(f"{n} ({why})" for n, why in skipped))
    hidden = "" if wide else "--wide adds each row's note; "
    console.print(f"{hidden}--json / --markdown keep every column, the note and the command that reproduces "
                  "each row (python -m splitkv bench --suite SUITE --shapes SHAPE --providers PROVIDER)",
                  highlight=False)
    if explain:
        for r in rows:
            if r["plan"] or r["graph_plan"]:
                console.print(f"[bold]{r['shape']} {r['provider']}[/]\n  eager: {escape(str(r['plan']))}"
                              f"\n  graph: {escape(str(r['graph_plan']))}\n  cmd:   {r['cmd']}", highlight=False)


def print_sweep(console, sweep: list[dict]) -> None:
    from rich.table import Table

    tiles = bool(sweep) and sweep[0].get("sweep") == "tiles"
    what = "tile" if tiles else "splits"
    table = Table(title=f"{what if tiles else 'num_splits'} sweep: planner's pick vs best measured")
    for col in ("shape", "mode", f"planner {what}", "planner µs", f"best {what}", "best µs", "regret %"):
        table.add_column(col, justify="left" if col in ("shape", "mode") else "right")
    for s in sweep:
        regret = s["regret_pct"]
        color = "green" if regret is not None and regret <= 5 else "red"
        table.add_row(s["shape"], s["mode"], str(s[f"planner_{what}"]),
                      _f(s["planner_us"], ".1f"), str(s[f"best_{what}"]),
                      _f(s["best_us"], ".1f"), f"[{color}]{_f(regret, '.1f')}[/]")
    console.print(table)


def argv_str(argv) -> str:
    return " ".join(argv if argv is not None else sys.argv[1:])
