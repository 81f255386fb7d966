"""First impressions of `python -m splitkv` on a CPU: the launcher answers without importing torch,
the lazy package still exports what the eager one did, `bench --quick` is honest about the device
(no H200 SOL, a readable bandwidth unit, an explained ratio, a table that fits, progress per row),
and `heatmap` with its defaults draws a map of splits, not a one-row strip."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitkv import heuristics, viz
from splitkv.bench import cli, report

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_SECONDS = 1.0  # python start-up + argparse-free dispatch; importing torch alone takes longer


def _imported(stderr: str) -> set[str]:
    """Module names listed by -X importtime."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("argv, rc, text", [
    (["--help"], 0, "usage: python -m splitkv"),
    (["-h"], 0, "usage: python -m splitkv"),
    ([], 2, "usage: python -m splitkv"),
    (["--version"], 0, "splitkv"),
    (["no-such-command"], 2, "unknown command 'no-such-command'"),
    (["demo", "--help"], 0, "usage: python -m splitkv demo"),
    (["bench", "-h"], 0, "usage: python -m splitkv bench"),
    (["heatmap", "--help"], 0, "usage: python -m splitkv heatmap"),
    (["compile", "--help"], 0, "usage: python -m splitkv compile"),
])
def test_launcher_answers_without_torch(argv, rc, text):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "splitkv", *argv], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    elapsed = time.perf_counter() - t0
    assert out.returncode == rc, out.stderr[-2000:]
    assert text in out.stdout + out.stderr
    mods = _imported(out.stderr)
    assert "splitkv" in mods  # the package itself was imported (and timed)
    heavy = sorted(m for m in mods if m.split(".")[0] in ("torch", "triton", "numpy", "rich", "matplotlib"))
    assert not heavy, heavy[:10]
    assert elapsed < LAUNCHER_SECONDS, f"{argv}: {elapsed:.2f} s"


def test_lazy_package_exports_what_the_eager_one_did():
    code = r"""
import sys, types
import splitkv
assert "torch" not in sys.modules, "import splitkv loaded torch"
assert set(splitkv.__all__) <= set(dir(splitkv))
for name in splitkv.__all__:
    assert getattr(splitkv, name) is not None, name
assert isinstance(splitkv.debug, types.ModuleType) and isinstance(splitkv.reference, types.ModuleType)
assert callable(splitkv.plan) and callable(splitkv.warmup) and callable(splitkv.decode)
import splitkv.plan as p  # the function wins over the submodule, as in the eager package
assert p is splitkv.plan and callable(p)
from splitkv.plan import DecodePlan, build
assert DecodePlan is splitkv.DecodePlan
import splitkv.warmup
assert callable(splitkv.warmup)
from splitkv import plan, warmup, debug, heuristics
assert plan is splitkv.plan and callable(warmup) and debug is splitkv.debug
assert splitkv.heuristics is heuristics and splitkv.backends.get
try:
    splitkv.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("splitkv.no_such_name resolved")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.fixture(scope="module")
def cpu_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_bench")
    argv = ["--quick", "--device", "cpu", "--reps", "1", "--no-host", "--shapes", "b1-l256-*,b2-l300-*",
            "--json", str(out / "b.json"), "--markdown", str(out / "b.md")]
    return argv, out


def test_bench_quick_on_cpu_is_honest_and_fits(cpu_bench, capsys):
    argv, out = cpu_bench
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "b.json").read_text())
    md = (out / "b.md").read_text()
    # no speed of light borrowed from an H200 for a CPU run
    assert doc["meta"]["sol_tbps"] is None
    assert all(r["eager_pct_sol"] is None and r["graph_pct_sol"] is None for r in doc["rows"])
    assert "SOL" not in text.replace("No %SOL", "") and "4.8 TB/s" not in text
    assert "SOL = 4.8" not in md and "no SOL" in md
    assert report.device_sol_tbps("cpu") is None
    # progress: one line per row, in a log
    rows = doc["rows"]
    progress = [line for line in text.splitlines() if re.match(r"\[\s*\d+/\d+\] ", line)]
    assert len(progress) == len(rows) == 6, progress
    # the table: GB/s, an explained ratio, at most 160 columns
    table = text[text.index("splitkv bench on cpu"):]
    assert "GB/s" in table and "TB/s" not in table and "vs best peer" in table
    assert "best peer" in table and re.search(r"\d× (slower|faster)", table)
    assert re.search(r"vs best peer: against the fastest peer", table)
    widest = max(len(line.rstrip()) for line in table.splitlines() if "splitkv-torch" in line or "shape" in line)
    assert widest <= 160, widest
    assert "--providers splitkv-torch" not in table  # reproduce commands live in --json / --markdown
    assert "`python -m splitkv bench --suite quick --shapes b1-l256-h4x2-d64 --providers splitkv-torch " in md


def test_bench_sol_comes_from_the_device_or_the_flag(monkeypatch):
    monkeypatch.setattr(report.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert report.device_sol_tbps("cuda:0") == report.SOL_TBPS
    monkeypatch.setattr(report.torch.cuda, "get_device_name", lambda device=None: "NVIDIA GH200 480GB")
    assert report.device_sol_tbps("cuda:0") is None  # not an H200: no borrowed peak
    monkeypatch.setattr(report.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert report.device_sol_tbps("cuda:0") == pytest.approx(3.35)
    row = dict.fromkeys(report.FIELDS)
    row.update(shape="s", dtype="bf16", provider="p", kind="peer", bytes=2_000_000, eager_us=1.0)
    report.finalize([row], None)
    assert row["eager_tbps"] == pytest.approx(2.0) and row["eager_pct_sol"] is None
    report.finalize([row], 4.0)
    assert row["eager_pct_sol"] == pytest.approx(50.0)
    assert report.gbps(2e-4) == "0.20" and report.gbps(4.8) == "4,800" and report.gbps(None) == "—"


def test_bench_explicit_sol_is_used(cpu_bench, capsys):
    argv, out = cpu_bench
    assert cli.main(argv[:-4] + ["--no-progress", "--sol-tbps", "0.01", "--json", str(out / "s.json")]) == 0
    doc = json.loads((out / "s.json").read_text())
    assert doc["meta"]["sol_tbps"] == 0.01
    assert all(r["eager_pct_sol"] > 0 for r in doc["rows"] if r["status"] == "ok")
    assert "%SOL: of 0.01 TB/s" in capsys.readouterr().out


def _heatmap(monkeypatch, tmp_path, *extra):
    """heatmap_main on a small CPU problem the planner does not split (one SM's worth of work)."""
    monkeypatch.setattr(heuristics, "CPU_NUM_SMS", 1)
    reports = []
    real = viz.lse_heatmap

    def spy(*args, **kw):
        reports.append(real(*args, **kw))
        return reports[-1]

    monkeypatch.setattr(viz, "lse_heatmap", spy)
    png = tmp_path / "h.png"
    argv = ["--out", str(png), "--device", "cpu", "--batch", "1", "--seqlen", "1024", "--heads", "4/2",
            "--head-dim", "64", *extra]
    assert viz.heatmap_main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (rep,) = reports
    return rep


def test_heatmap_default_draws_several_split_rows(monkeypatch, tmp_path, capsys):
    import torch

    import splitkv

    lens = torch.full((1,), 1024, dtype=torch.int32)
    monkeypatch.setattr(heuristics, "CPU_NUM_SMS", 1)
    assert int(splitkv.plan(lens, 4, 2, 64).num_splits.max()) == 1  # the planner alone: a strip
    rep = _heatmap(monkeypatch, tmp_path)
    assert int(rep.num_splits.max()) == viz.SHOW_SPLITS > 1 and rep.lse.shape[0] == viz.SHOW_SPLITS
    out = capsys.readouterr().out
    assert "the planner splits these inputs into 1" in out and "forced" in out


def test_heatmap_num_splits_overrides(monkeypatch, tmp_path, capsys):
    for flag, rows in (("auto", 1), ("3", 3)):  # auto: the planner's own count, even a strip; N: N
        rep = _heatmap(monkeypatch, tmp_path, "--num-splits", flag)
        assert int(rep.num_splits.max()) == rows
        assert "forced splits to show" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, text", [
    (["--reps", "0"], "--reps"), (["--sol-tbps", "-1"], "--sol-tbps"),
    (["--device", "gpu"], "--device"), (["--device", "meta"], "--device"),
])
def test_bench_bad_flags_stop_before_any_timing(argv, text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--suite", "cpu", "--no-progress", *argv])
    assert text in str(e.value.code) + capsys.readouterr().err


@pytest.mark.parametrize("argv, text", [
    (["--arch", "garbage"], "--arch"), (["--only", "("], "--only"), (["--group-sizes", "0"], "--group-sizes"),
])
def test_compile_bad_flags_are_usage_errors(argv, text, capsys):
    from splitkv import compile_cli

    with pytest.raises(SystemExit) as e:
        compile_cli.main(["--backend", "cutlass", *argv])
    assert e.value.code == 2 and text in capsys.readouterr().err
