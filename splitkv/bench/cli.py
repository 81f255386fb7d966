"""`python -m splitkv bench`: argument parsing, progress, and wiring of the bench modules.

Exit status: 0, or 1 when a splitkv row failed or its error vs the reference exceeds
report.ERR_WARN relative (a peer's failure never changes the status).
"""

from __future__ import annotations

import time

import torch

from ..cli_args import bench_parser as build_parser
from . import registry, report, runner, shapes
from .sweep import parse_range, parse_tiles, run_sweep, run_tile_sweep

SWEEP_RANGE = {"full": "1:64", "peers": "1:64", "headline": "1:64", "quick": "1:8"}


def _device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise SystemExit(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device: CUDA is not available on this machine")
    return dev


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


class _Progress:
    """rich progress bar on a terminal, advanced by every row; one plain line per row otherwise (logs of
    remote runs), with the row's result when there is one."""

    def __init__(self, console, total: int, enabled: bool):
        self.console, self.total, self.enabled = console, total, enabled
        self.bar = self.task = None
        self.done, self.last, self.t0 = 0, None, time.perf_counter()

    def __enter__(self):
        if self.enabled and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("bench", total=self.total)
        return self

    def step(self, shape: str, what, row: dict | None = None) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{shape} · {what}")
        elif self.enabled:
            result = ""
            if row is not None:
                result = (f"  {row['eager_us']:.1f} µs" if row["status"] == "ok" and row["eager_us"]
                          else f"  {row['status']}")
            width = len(str(self.total))
            self.console.print(f"[{self.done:{width}d}/{self.total}] {shape}  {what}{result}  "
                               f"({time.perf_counter() - self.t0:.0f} s)", highlight=False, markup=False)
        self.last = shape

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)


# model-level benchmarks (transformers needed): `python -m splitkv bench hf-step|hf-serve [options]`
MODEL_BENCHES = {"hf-step": "hf_step", "hf-serve": "hf_serve"}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    if argv and argv[0] in MODEL_BENCHES:
        import importlib

        return int(importlib.import_module(f".{MODEL_BENCHES[argv[0]]}", __package__).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    suite_name = "quick" if args.quick else args.suite
    device = _device(args.device)
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    bad = [d for d in dtypes if d not in runner.DTYPES]
    if bad or not dtypes:
        raise SystemExit(f"--dtypes: expected a list of {tuple(runner.DTYPES)}, got {args.dtypes!r}")
    sweep = args.num_splits == "sweep"
    tile_sweep = args.sweep_tiles is not None
    forced = None
    if args.num_splits not in ("auto", "sweep"):
        if not args.num_splits.isdigit() or int(args.num_splits) < 1:
            raise SystemExit(f"--num-splits: expected auto, sweep or an int >= 1, got {args.num_splits!r}")
        forced = int(args.num_splits)
    splits = None
    if sweep:
        try:
            splits = parse_range(args.sweep_range or SWEEP_RANGE[suite_name])
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    backends = (tuple(b.strip() for b in args.backends.split(",") if b.strip()) if args.backends
                else registry.default_backends(device))
    if args.host_breakdown:
        from . import host

        meta = report.collect_meta(device, report.argv_str(argv).split(), None)
        out = Console(highlight=False, width=160)
        try:
            host.run(device, args.host_shape, backends if args.backends else None, args.reps, meta,
                     args.json, args.markdown, say=lambda text: out.print(text, markup=False))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        return 0
    reps = args.reps if args.reps is not None else (3 if suite_name == "quick" else 20)
    cfg = runner.Config(device=device, suite=suite_name, dtypes=dtypes, reps=max(reps, 1),
                        graph=not args.no_graph, host=not args.no_host, num_splits=forced, seed=args.seed,
                        flush=args.flush)
    selected = shapes.select(shapes.suite(suite_name), args.shapes)
    if not selected:
        raise SystemExit(f"--shapes: no shape of suite {suite_name!r} matches {args.shapes!r} (see --list)")
    try:
        providers, skipped = registry.select(args.providers, backends, forced)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    console = Console(highlight=False)
    if not console.is_terminal:  # logs of remote runs: wide enough that rows do not wrap
        console = Console(highlight=False, width=220 if args.wide else 160)
    sol = args.sol_tbps if args.sol_tbps is not None else report.device_sol_tbps(device)
    argv_text = report.argv_str(argv)
    if args.list:
        for s in selected:
            console.print(f"{s.name:44s} {s.bytes(2) / 1e6:10.1f} MB (bf16)")
        console.print("providers: " + ", ".join(p.name for p in providers))
        if skipped:
            console.print("skipped: " + "; ".join(f"{n} ({r})" for n, r in skipped))
        return 0
    rows: list[dict] = []
    sweep_rows: list[dict] = []

    def write(note: str | None = None) -> None:
        meta = report.collect_meta(device, argv_text.split(), sol, cfg.flush)
        meta.update(suite=suite_name, reps=cfg.reps, graph=cfg.graph, host=cfg.host, num_splits=args.num_splits)
        if note:
            meta["incomplete"] = note
        if args.json:
            report.write_json(args.json, meta, skipped, rows, sweep_rows)
        if args.markdown:
            report.write_markdown(args.markdown, meta, skipped, rows, sweep_rows)

    try:
        if not ((sweep or tile_sweep) and args.sweep_only):
            total = len(selected) * len(providers) * len(dtypes)
            with _Progress(console, total, not args.no_progress) as prog:
                runner.run(selected, providers, cfg, on_step=lambda s, p: prog.step(s, p, rows[-1]), rows=rows)
            report.finalize(rows, sol)
            report.print_table(console, rows, skipped, explain=args.explain, device=_device_name(device),
                               sol_tbps=sol, wide=args.wide)
        if sweep:
            sweep_rows += _sweep(args, cfg, suite_name, selected, providers, splits, console)
        if tile_sweep:
            sweep_rows += _sweep(args, cfg, suite_name, selected, providers, None, console, tiles=args.sweep_tiles)
    except BaseException as exc:  # a CUDA fault or ^C: keep what was measured, then stop
        report.finalize(rows, sol)
        write(f"stopped after {len(rows)} rows: {type(exc).__name__}: {exc}")
        raise
    write()
    if args.plot:
        from .plots import write_plots

        for path in write_plots(rows, args.plot, sol, sweep_rows):
            console.print(f"wrote {path}")
    ours = [r for r in rows if r["kind"] == "splitkv"]
    failed = [r for r in ours if r["status"] == "error" or report.err_flag(r)]
    for r in failed:
        console.print(f"[red]FAILED[/] {r['shape']} {r['provider']}: status={r['status']} "
                      f"rel_err={r['rel_err']} graph_rel_err={r['graph_rel_err']} {r['note']}")
    return 1 if failed else 0


def _sweep(args, cfg, suite_name, selected, providers, splits, console, tiles: str | None = None) -> list[dict]:
    """The num_splits sweep (splits) or the tile sweep (tiles: the --sweep-tiles text) of every
    selected splitkv backend on the sweep shapes."""
    ours = [p for p in providers if p.kind == "splitkv"]
    if not ours:
        console.print("sweep: no splitkv backend selected; skipped")
        return []
    patterns = args.sweep_shapes or ",".join(shapes.SWEEP_DEFAULT.get(suite_name, ()))
    targets = shapes.select(selected, patterns)
    if not targets and args.shapes and not args.sweep_shapes:
        targets = selected  # the user narrowed the suite to shapes outside the default subset
    if not targets:
        console.print(f"sweep: no selected shape matches {patterns!r}; skipped")
        return []
    if tiles is None:
        backend = ours[0].backend
        with _Progress(console, len(targets) * len(splits), not args.no_progress) as prog:
            result = run_sweep(targets, backend, cfg, splits, on_step=prog.step)
        report.print_sweep(console, result)
        return result
    result = []
    for backend in dict.fromkeys(p.backend for p in ours):  # each backend once, in the order given
        try:
            tile_list = parse_tiles(tiles, backend)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        with _Progress(console, len(targets) * len(tile_list), not args.no_progress) as prog:
            rows = run_tile_sweep(targets, backend, cfg, tile_list, on_step=prog.step)
        report.print_sweep(console, rows)
        result += rows
    return result
