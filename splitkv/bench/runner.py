"""The suite loop: for each shape build the inputs and the fp64 reference once, then for each
provider check its output and time it eager (GPU time, L2 flushed), on the host (CPU time per call
of a launch loop) and under CUDA-graph replay. One row per (shape, dtype, provider); failures of
one provider become that row's status, never the run's."""

from __future__ import annotations

import gc
import math
import warnings
from dataclasses import dataclass

import torch

from .check import build_reference
from .inputs import build_case
from .providers import is_rejection
from .report import new_row
from .timing import time_eager, time_graph, time_host

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Config:
    device: torch.device
    suite: str = "full"
    dtypes: tuple[str, ...] = ("bf16",)
    reps: int = 20
    graph: bool = True
    host: bool = True
    num_splits: int | None = None
    seed: int = 0
    flush: str = "write"  # timing.FLUSHES


def row_command(cfg: Config, shape, provider, dtype: str) -> str:
    cmd = (f"python -m splitkv bench --suite {cfg.suite} --shapes {shape.name} "
           f"--providers {provider.name} --dtypes {dtype}")
    if cfg.device.type == "cpu":
        cmd += " --device cpu"
    if not cfg.graph:
        cmd += " --no-graph"
    if not cfg.host:
        cmd += " --no-host"
    if cfg.flush != "write":
        cmd += f" --flush {cfg.flush}"
    if cfg.num_splits is not None and provider.kind == "splitkv":
        cmd += f" --num-splits {cfg.num_splits}"
    return cmd


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}"


def _first_call(provider, case):
    """(session, output of one call): compiles / JITs. On failure the exception carries the warnings
    raised on the way (SDPA explains why it rejected a problem only through warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            session = provider.session(case, graph=False)
            with session.context():
                return session, session.bind(case.base)()
        except Exception as exc:
            exc.hints = [str(w.message).split("\n")[0] for w in caught]
            raise


def measure(case, ref, provider, cfg: Config, dtype: str, graph: bool = True) -> dict:
    """One row: check, eager and host timing, then (graph=True) GRAPH_CAPTURES graph captures in a
    row. run() passes graph=False and takes the captures itself, interleaved across providers."""
    shape = case.shape
    row = new_row(shape, provider, dtype, case.elem_bytes, row_command(cfg, shape, provider, dtype))
    reason = provider.unsupported(case)
    if reason:
        row.update(status="n/a", note=reason)
        return row
    try:
        session, o = _first_call(provider, case)
    except Exception as exc:  # noqa: BLE001 - a peer's failure is reported in its row, not raised
        hints = getattr(exc, "hints", [])
        note = _short(exc)
        if is_rejection(exc) and hints:
            note = "rejected: " + " / ".join(hints[:2])[:240]
        row.update(status="n/a" if is_rejection(exc) else "error", note=note)
        return row
    row["note"] = session.note
    row["plan"] = session.plan_text
    err, rel = ref.error(o)
    row.update(max_abs_err=err, rel_err=rel, err_scope=ref.scope)
    if math.isnan(err):
        row["note"] = (row["note"] + "; " if row["note"] else "") + "NaN in output"
    del o
    fn = session.bind(case.base)
    with session.context():
        row["eager_us"], row["eager_reps"] = time_eager(fn, case.device, cfg.reps, cfg.flush)
        if cfg.host:
            try:
                row["host_us"], row["host_calls"] = time_host(fn, case.device)
            except Exception as exc:  # noqa: BLE001 - a host-loop failure is the row's note, not the run's
                row["note"] = (row["note"] + "; " if row["note"] else "") + "host: " + _short(exc)
    session.close()
    if graph and _graphs(case, provider, cfg, row):
        for _ in range(GRAPH_CAPTURES):
            if not graph_capture(case, ref, provider, cfg, row):
                break
    return row


# Each graph row times this many fresh captures of its calls and keeps the fastest; run() takes them
# in rounds over the shape's providers (capture 1 of every provider, then capture 2 ...), so no
# provider's row is only captures taken first at its shape. On the H200 (2026-12-04,
# results/2026-12-04-h200-layout/probe_settle.py) the first capture after the case's fp64
# reference ran B=1 GQA 32/8 32K at 40.2-40.5 us per call in 13 of 15 trials and the next at
# 36.5-36.6. On the H100 (2026-12-05, benchmarks/probes/probe_first_graph.py,
# results/2026-12-05-h100-fp8-tiles/) the first provider of a B=1 fp8 shape ran its first 1-3
# captures ~15% slow (Triton B=1 GQA 128K e4m3 116.3 / 116.8 / 100.9 / 101.0 us; paged 16
# 118.8 / 118.5 / 118.4 / 102.6) and the same provider measured again after another's captures
# ran at the recovered level from its first capture; two captures in a row missed it. Its cause
# is not known.
GRAPH_CAPTURES = 2


def _graphs(case, provider, cfg: Config, row: dict) -> bool:
    """Whether the row gets graph captures (a provider that cannot be captured says why in its note)."""
    if row["status"] != "ok" or not cfg.graph or case.device.type != "cuda":
        return False
    if not provider.graphable:
        row["note"] = (row["note"] + "; " if row["note"] else "") + provider.graph_note
    return provider.graphable


def graph_capture(case, ref, provider, cfg: Config, row: dict) -> bool:
    """One fresh capture of the provider's calls, folded into row: graph_us is the fastest capture
    so far, the errors the worst capture's. False when it failed (the note says why): callers take
    no more captures for that row."""
    try:
        session = provider.session(case, graph=True)
        row["graph_plan"] = session.plan_text
        sets = case.rotation(case.rotation_count())
        with session.context():
            fns = [session.bind(ts) for ts in sets]
            us, calls, replays, out = time_graph(fns, case.device, cfg.reps)
        row["graph_captures_us"] = (row["graph_captures_us"] or []) + [round(us, 2)]
        if row["graph_us"] is None or us < row["graph_us"]:
            row.update(graph_us=us, graph_calls=calls, graph_replays=replays)
        err = ref.error(out)  # every capture's output is checked: the worst is reported
        worst = row["graph_max_abs_err"]
        if worst is None or math.isnan(err[0]) or (not math.isnan(worst) and err[0] > worst):
            row["graph_max_abs_err"], row["graph_rel_err"] = err
        session.close()
        return True
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize(case.device)
        row["note"] = (row["note"] + "; " if row["note"] else "") + "graph: " + _short(exc)
        return False


def run(shapes, providers, cfg: Config, on_step=None, rows: list | None = None) -> list[dict]:
    """Rows for every (shape, dtype, provider), appended to `rows` as they finish (so a crash part
    way still leaves them to the caller). on_step(shape_name, provider_name) after each row's eager
    timing; a shape's graph captures follow in rounds over its providers (GRAPH_CAPTURES)."""
    rows = [] if rows is None else rows
    for dtype in cfg.dtypes:
        for shape in shapes:
            case = build_case(shape, DTYPES[dtype], cfg.device, cfg.seed)
            ref = build_reference(case)
            shape_rows = []  # also in rows at once (graph captures fill them in place)
            for provider in providers:
                shape_rows.append(measure(case, ref, provider, cfg, dtype, graph=False))
                rows.append(shape_rows[-1])
                if on_step:
                    on_step(shape.name, provider.name)
            graphed = [(p, r) for p, r in zip(providers, shape_rows, strict=True) if _graphs(case, p, cfg, r)]
            for _ in range(GRAPH_CAPTURES):  # rounds: see GRAPH_CAPTURES; a failed row leaves them
                graphed = [(p, r) for p, r in graphed if graph_capture(case, ref, p, cfg, r)]
            case.release()
            del case, ref
            gc.collect()
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows
