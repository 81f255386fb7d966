"""The model benchmarks' CPU smoke runs (python -m splitkv bench hf-step / hf-serve --tiny):
they run end to end and write what their results READMEs read. Skips without transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _run(command, tmp_path, *args):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "splitkv", "bench", command, "--out", str(out), "--device", "cpu",
                    "--tiny", *args], check=True, cwd=ROOT, capture_output=True, timeout=600)
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_hf_step_smoke(tmp_path):
    doc, md = _run("hf-step", tmp_path, "--providers", "splitkv-eager,transformers-sdpa-dynamic")
    assert {(r["provider"], r["batch"]) for r in doc["rows"]} == {(p, b) for p in ("splitkv-eager",
                                                                                     "transformers-sdpa-dynamic")
                                                                  for b in (1, 2)}
    assert all(r["ms_per_step"] > 0 and r["x_floor"] > 0 for r in doc["rows"])
    assert "| 1 | 256 | splitkv-eager |" in md
    assert doc["meta"]["command"].startswith("python -m splitkv bench hf-step --out")


def test_hf_serve_smoke(tmp_path):
    doc, md = _run("hf-serve", tmp_path, "--patterns", "burst,poisson", "--plot", str(tmp_path))
    rows = {(r["engine"], r["pattern"]): r for r in doc["rows"]}
    assert set(rows) == {(e, p) for e in ("splitkv", "transformers") for p in ("burst", "poisson")}
    for r in rows.values():  # every request got all its tokens; the metrics are there
        assert r["complete"] and r["output_tokens"] > 0 and r["ttft_p50_s"] >= 0 and r["tpot_p99_ms"] > 0
    assert (tmp_path / "hf_serve.png").stat().st_size > 0
    assert "| splitkv | burst |" in md
