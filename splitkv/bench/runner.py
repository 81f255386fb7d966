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


def row_command(cfg: Config, shape, provider, dtype: str) -> str:
    cmd = (f"python -m splitkv bench --suite {cfg.suite} --shapes {shape.name} "
           f"--providers {provider.name} --dtypes {dtype}")
    if cfg.device.type == "cpu":
        cmd += " --device cpu"
    if not cfg.graph:
        cmd += " --no-graph"
    if not cfg.host:
        cmd += " --no-host"
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


def measure(case, ref, provider, cfg: Config, dtype: str) -> dict:
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
        row["eager_us"], row["eager_reps"] = time_eager(fn, case.device, cfg.reps)
        if cfg.host:
            try:
                row["host_us"], row["host_calls"] = time_host(fn, case.device)
            except Exception as exc:  # noqa: BLE001 - a host-loop failure is the row's note, not the run's
                row["note"] = (row["note"] + "; " if row["note"] else "") + "host: " + _short(exc)
    session.close()
    if cfg.graph and case.device.type == "cuda":
        if not provider.graphable:
            row["note"] = (row["note"] + "; " if row["note"] else "") + provider.graph_note
        else:
            _measure_graph(case, ref, provider, cfg, row)
    return row


# Each graph row times this many fresh captures of its calls and keeps the fastest. On the H200
# (2026-12-04, results/2026-12-04-h200-layout/probe_settle.py) the first capture after the
# case's fp64 reference ran B=1 GQA 32/8 32K at 40.2-40.5 us per call in 13 of 15 trials, with
# pauses of 0-1 s or another graph in between, and the next capture at 36.5-36.6 every time (a
# fresh process: 36.4); the first provider of every shape (splitkv-<backend>-noplan) took that
# penalty alone. Its cause is not known.
GRAPH_CAPTURES = 2


def _measure_graph(case, ref, provider, cfg: Config, row: dict) -> None:
    try:
        session = provider.session(case, graph=True)
        row["graph_plan"] = session.plan_text
        sets = case.rotation(case.rotation_count())
        with session.context():
            fns = [session.bind(ts) for ts in sets]
            runs = [time_graph(fns, case.device, cfg.reps) for _ in range(GRAPH_CAPTURES)]
        us, calls, replays, _ = min(runs, key=lambda r: r[0])
        row.update(graph_us=us, graph_calls=calls, graph_replays=replays)
        errs = [ref.error(r[3]) for r in runs]  # every capture's output is checked: the worst is reported
        row["graph_max_abs_err"], row["graph_rel_err"] = max(errs, key=lambda e: (math.isnan(e[0]), e[0]))
        session.close()
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize(case.device)
        row["note"] = (row["note"] + "; " if row["note"] else "") + "graph: " + _short(exc)


def run(shapes, providers, cfg: Config, on_step=None, rows: list | None = None) -> list[dict]:
    """Rows for every (shape, dtype, provider), appended to `rows` as they finish (so a crash part
    way still leaves them to the caller). on_step(shape_name, provider_name) after each row."""
    rows = [] if rows is None else rows
    for dtype in cfg.dtypes:
        for shape in shapes:
            case = build_case(shape, DTYPES[dtype], cfg.device, cfg.seed)
            ref = build_reference(case)
            for provider in providers:
                rows.append(measure(case, ref, provider, cfg, dtype))
                if on_step:
                    on_step(shape.name, provider.name)
            case.release()
            del case, ref
            gc.collect()
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows
