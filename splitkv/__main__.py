"""Command line: python -m splitkv {demo, bench, heatmap, compile} [options]."""

from __future__ import annotations

import importlib
import sys

# commands whose module imports torch: their parser (splitkv.cli_args) answers --help without it
HELP_PARSERS = {"demo": "demo_parser", "bench": "bench_parser", "heatmap": "heatmap_parser"}
COMMANDS = {
    "demo": ("splitkv.demo", "main", "long-context decode per backend, checked against the reference"),
    "bench": ("splitkv.bench.cli", "main", "benchmark suite against peers (json, markdown, plots)"),
    "heatmap": ("splitkv.viz", "heatmap_main", "per-split LSE heat map of a real decode, with anomaly flags"),
    "compile": ("splitkv.compile_cli", "main", "compile every CUTLASS kernel variant (no GPU needed)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"splitkv {version('splitkv')}")
        except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
            print("splitkv (not installed)")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"splitkv: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: python -m splitkv {" + ",".join(COMMANDS) + "} [options] | --version\n")
        for name, (_, _, text) in COMMANDS.items():
            print(f"  {name:8s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    model_bench = argv[0] == "bench" and len(argv) > 1 and argv[1] in ("hf-step", "hf-serve")  # own parsers
    if argv[0] in HELP_PARSERS and not model_bench and any(a in ("-h", "--help") for a in argv[1:]):
        getattr(importlib.import_module("splitkv.cli_args"), HELP_PARSERS[argv[0]])().parse_args(argv[1:])
    module, func, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
