"""splitkv.bench on the CPU: schema, byte model, error columns, n/a rows, plots, sweep, provider
modes (plan reused / no plan), host column, the headline suite gpu_run.sh runs, the host breakdown, the tile sweep.
No timing assertions (CPU times say nothing about the GPU)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_drawn_png

import splitkv.bench as bench
from splitkv.bench import check, cli, inputs, registry, report, runner, shapes
from splitkv.bench.providers import Provider, Session, SplitKV
from splitkv.bench.timing import time_host
from splitkv.reference import decode_reference, gather_keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One CPU run of the quick suite with every output on (the runs are the slow part)."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["--quick", "--device", "cpu", "--no-progress", "--json", str(out / "bench.json"),
            "--markdown", str(out / "bench.md"), "--plot", str(out / "plots"), "--num-splits", "sweep",
            "--sweep-range", "1:4", "--reps", "2"]
    rc = cli.main(argv)
    return rc, out, json.loads((out / "bench.json").read_text())


def test_quick_json_has_documented_schema(quick_run):
    rc, _, doc = quick_run
    assert rc == 0
    assert doc["schema"] == report.SCHEMA
    for key in ("date", "device", "driver", "torch", "triton", "cutlass", "sol_tbps", "command"):
        assert key in doc["meta"]
    assert doc["rows"]
    for row in doc["rows"]:
        assert tuple(row) == report.FIELDS
    for field in report.FIELDS:  # the module docstring documents every field
        assert field in bench.__doc__, field


def test_quick_rows_error_columns_filled(quick_run):
    _, _, doc = quick_run
    by = {(r["shape"], r["provider"]): r for r in doc["rows"]}
    ok = [r for r in doc["rows"] if r["status"] == "ok"]
    # ours in both calling modes and a peer are checked
    assert {r["provider"] for r in ok} >= {"splitkv-torch", "splitkv-torch-noplan", "sdpa-flash"}
    for r in ok:
        assert r["max_abs_err"] is not None and r["rel_err"] is not None and r["err_scope"] == "all"
        assert r["rel_err"] < report.ERR_WARN, r
        assert r["eager_us"] > 0 and r["eager_reps"] >= 1
        assert r["host_us"] > 0 and r["host_calls"] >= 1  # every provider has a host column
        assert r["eager_tbps"] == pytest.approx(r["bytes"] / r["eager_us"] / 1e6)
        assert r["graph_us"] is None  # no CUDA graphs on a CPU
        assert r["cmd"].startswith("python -m splitkv bench --suite quick --shapes " + r["shape"])
    assert all(r["status"] == "ok" for r in doc["rows"] if r["kind"] == "splitkv")
    for r in ok:  # the two modes: a plan made once (described), or decode planning every call
        if r["provider"] == "splitkv-torch":
            assert r["plan"].startswith("DecodePlan") and "reused" in r["note"]
            assert "--providers splitkv-torch " in r["cmd"]
        elif r["provider"] == "splitkv-torch-noplan":
            assert r["plan"].startswith("decode plans itself") and "no plan" in r["note"]
            assert "--providers splitkv-torch-noplan " in r["cmd"]
    assert doc["meta"]["host"] is True
    # peers that cannot take a layout are n/a, not emulated
    paged = [s.name for s in shapes.quick_suite() if s.paged]
    ragged = [s.name for s in shapes.quick_suite() if not s.uniform]
    for name in paged + ragged:
        assert by[(name, "sdpa-flash")]["status"] == "n/a"
        assert by[(name, "sdpa-flash")]["max_abs_err"] is None
    # ratio vs the best peer: the peer itself is 1.0
    grid = [r for r in ok if r["provider"] == "sdpa-flash"]
    assert grid and all(r["eager_vs_best_peer"] == pytest.approx(1.0) for r in grid)
    skipped = {s["provider"] for s in doc["skipped_providers"]}
    if not torch.cuda.is_available():
        assert {"sdpa-cudnn", "flashinfer"} <= skipped


def test_quick_markdown_and_sweep(quick_run):
    _, out, doc = quick_run
    md = (out / "bench.md").read_text()
    assert "| shape |" in md and "splitkv-torch" in md and "planner" in md
    header = next(line for line in md.splitlines() if line.startswith("| shape |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols == ["shape", "dtype", "provider", *report.COLUMNS, "note", "reproduce"]
    assert {"eager µs", "graph µs", "host µs/call"} <= set(cols)
    for line in md.splitlines():  # every row (main table and sweep) carries the command that reproduces it
        if line.startswith("| b"):
            assert re.search(r"`python -m splitkv bench --suite quick --shapes b\S+ --providers ", line), line
    (sw,) = doc["sweep"]
    assert sw["shape"] == "b1-l1k-h4x2-d64" and sw["mode"] == "eager"
    assert 1 <= sw["planner_splits"] and 1 <= sw["best_splits"] <= 4
    assert math.isfinite(sw["regret_pct"]) and len(sw["curve"]) >= 2


def test_plots_are_nontrivial_pngs(quick_run):
    _, out, _ = quick_run
    pngs = sorted((out / "plots").glob("*.png"))
    names = {p.name for p in pngs}
    assert "speedup_eager.png" in names and "sweep.png" in names
    assert any(n.startswith("bandwidth_") for n in names)
    for p in pngs:
        assert_drawn_png(p)


def test_byte_model_counts_valid_kv_plus_q_and_o():
    # K+V: 2 * (10 + 20) keys * 2 heads * 8 dims * 2 B = 1920
    # q+o: 2 * 2 requests * 3 tokens * 4 heads * 8 dims * 2 B = 768
    assert shapes.byte_model([10, 20], 4, 2, 8, 3, 2) == 1920 + 768
    s = shapes.make_shape(2, (10, 20), 4, 2, 8, q_len=3)
    assert s.bytes(2) == 1920 + 768 and s.kv_bytes(2) == 1920


def test_suites_match_peers_grid_and_names_are_unique():
    peers = shapes.peers_suite()
    names = [s.name for s in peers]
    assert len(names) == 31  # PEERS.md grid minus K+V > 8 GiB
    assert "b16-l128k-h32x8-d128" in names and "b64-l128k-h32x8-d128" not in names
    full = shapes.full_suite()
    assert len({s.name for s in full}) == len(full)
    assert any(s.paged and s.page_size == 16 for s in full)
    assert any(s.q_len == 4 and s.causal for s in full)
    ragged = [s for s in full if not s.uniform]
    assert ragged and min(ragged[0].seqlens) == 1024 and max(ragged[0].seqlens) == 131072
    assert {64, 256} <= {s.head_dim for s in full}
    assert [s.name for s in shapes.select(full, "b1-l4k-*-d128")] == [
        "b1-l4k-h32x32-d128", "b1-l4k-h32x8-d128", "b1-l4k-h64x8-d128"]
    assert shapes.select(full, "b1-l4k-h32x8-d128") == [s for s in full if s.name == "b1-l4k-h32x8-d128"]


@pytest.mark.parametrize("paged", [False, True])
def test_page_view_addresses_the_same_keys(paged):
    shape = shapes.make_shape(3, (17, 40, 33), 4, 2, 64, page_size=16 if paged else None)
    case = inputs.build_case(shape, torch.float32, "cpu", seed=1)
    ts = case.base
    k_pages, _, indptr, indices, last = inputs.page_view(ts, shape)
    for b, L in enumerate(shape.seqlens):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        keys = k_pages[pages].reshape(-1, 2, 64)
        assert int(last[b]) == L - 16 * (len(pages) - 1)
        torch.testing.assert_close(keys[:L], gather_keys(ts.k_cache, b, L, ts.block_table), rtol=0, atol=0)


def test_rotation_copies_are_distinct_and_equal():
    case = inputs.build_case(shapes.make_shape(1, 64, 2, 1, 64), torch.float32, "cpu")
    sets = case.rotation(3)
    assert sets[0] is case.base and len(sets) == 3
    assert sets[1].k_cache.data_ptr() != sets[0].k_cache.data_ptr()
    torch.testing.assert_close(sets[2].v_cache, sets[0].v_cache, rtol=0, atol=0)
    assert case.rotation_count() == inputs.MAX_ROTATION  # a 66 KB case needs the cap


def test_reference_subsample_maps_rows_and_heads(monkeypatch):
    monkeypatch.setattr(check, "FULL_CHECK_BYTES", 0)
    shape = shapes.make_shape(4, (30, 90, 17, 64), 8, 4, 64, page_size=16)
    case = inputs.build_case(shape, torch.float32, "cpu", seed=2)
    ref = check.build_reference(case)
    assert ref.rows == [1, 2] and ref.scope != "all"  # ragged: longest and shortest request
    assert ref.q_heads == [0, 1, 6, 7]  # KV heads 0 and 3, two query heads each
    ts = case.base
    o, _ = decode_reference(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, block_table=ts.block_table)
    err, rel = ref.error(o.float())
    assert err < 1e-5 and rel < 1e-5
    bad = o.clone()
    bad[2, 0, 7, 0] += 1.0
    assert ref.error(bad)[0] == pytest.approx(1.0, abs=1e-4)
    bad[0, 0, 3, 0] += 5.0  # request 0 / head 3 are outside the subsample
    assert ref.error(bad)[0] == pytest.approx(1.0, abs=1e-4)


class _Raises(Provider):
    name, kind = "broken", "peer"

    def __init__(self, exc):
        self.exc = exc

    def session(self, case, graph):
        exc = self.exc

        class S(Session):
            def bind(self, ts):
                def call():
                    raise exc
                return call

        return S()


def test_failing_peer_becomes_row_status_not_a_crash():
    shape = shapes.make_shape(1, 64, 2, 1, 64)
    case = inputs.build_case(shape, torch.bfloat16, "cpu")
    ref = check.build_reference(case)
    cfg = runner.Config(device=torch.device("cpu"), suite="quick", reps=1)
    row = runner.measure(case, ref, _Raises(RuntimeError("kernel exploded")), cfg, "bf16")
    assert row["status"] == "error" and "kernel exploded" in row["note"] and row["eager_us"] is None
    row = runner.measure(case, ref, _Raises(RuntimeError("No available kernel. Aborting")), cfg, "bf16")
    assert row["status"] == "n/a"


def test_finalize_ratio_vs_best_peer():
    def row(provider, kind, us):
        r = dict.fromkeys(report.FIELDS)
        r.update(shape="s", dtype="bf16", provider=provider, kind=kind, bytes=4_800_000, eager_us=us)
        return r

    rows = [row("splitkv-triton", "splitkv", 1.0), row("a", "peer", 2.0), row("b", "peer", 4.0),
            row("c", "peer", None)]
    report.finalize(rows, sol_tbps=4.8)
    assert rows[0]["eager_tbps"] == pytest.approx(4.8) and rows[0]["eager_pct_sol"] == pytest.approx(100)
    assert rows[0]["eager_vs_best_peer"] == pytest.approx(2.0) and rows[0]["best_peer_eager"] == "a"
    assert rows[2]["eager_vs_best_peer"] == pytest.approx(0.5)
    assert rows[3]["eager_vs_best_peer"] is None and rows[0]["graph_vs_best_peer"] is None


def test_provider_selection_and_cli_errors():
    names = registry.expand("splitkv,peers", ("triton",))
    assert names[0] == "splitkv-triton" and "sdpa-cudnn" in names and "flex" not in names
    assert "flex" in registry.expand("all", ("torch",))
    with pytest.raises(SystemExit):
        cli.main(["--quick", "--shapes", "no-such-shape", "--no-progress"])
    with pytest.raises(SystemExit):
        cli.main(["--quick", "--providers", "nope", "--no-progress"])
    with pytest.raises(SystemExit):
        cli.main(["--quick", "--num-splits", "sweep", "--sweep-range", "5:2", "--no-progress"])
    assert cli.main(["--quick", "--list", "--device", "cpu"]) == 0


def test_eager_timing_may_run_ten_times_the_cap_on_short_calls():
    """Eager repetitions are cheap (a call plus a flush): a short call runs EAGER_CAP_FACTOR x the cap,
    a call whose repetitions would pass TARGET_MS runs fewer."""
    import time

    from splitkv.bench import timing

    cpu = torch.device("cpu")
    assert timing.time_eager(lambda: None, cpu, 2)[1] == 2 * timing.EAGER_CAP_FACTOR
    assert timing.time_eager(lambda: time.sleep(timing.TARGET_MS / 4e3), cpu, 20)[1] < 20


def test_flush_read_reaches_the_eager_timer_and_the_report(monkeypatch, tmp_path):
    """--flush read: every eager timing gets flush="read", rows reproduce with it, the report's
    timing line says so; a flush the timer does not know is refused by name."""
    from splitkv.bench import cli, runner, timing

    seen = []

    def spy(fn, device, reps, flush="write"):
        seen.append(flush)
        return 1.0, 1

    monkeypatch.setattr(runner, "time_eager", spy)
    rc = cli.main(["--quick", "--device", "cpu", "--no-progress", "--providers", "splitkv-torch", "--shapes",
                   "b1-l1k*", "--reps", "1", "--no-host", "--flush", "read", "--json", str(tmp_path / "r.json")])
    assert rc == 0 and seen and set(seen) == {"read"}
    data = json.loads((tmp_path / "r.json").read_text())
    assert "256 MB read" in data["meta"]["timing"]
    assert all(r["cmd"].endswith("--flush read") for r in data["rows"])
    with pytest.raises(ValueError, match="flush"):
        timing.time_eager(lambda: None, torch.device("cpu"), 1, flush="memset")
    with pytest.raises(SystemExit):
        cli.main(["--quick", "--device", "cpu", "--flush", "memset"])


def test_graph_rows_check_the_graph_safe_output(monkeypatch):
    """The graph branch (CUDA-only timing) with the timer faked: a graph-safe plan over rotation sets,
    and the captured output is checked against the reference like the eager one."""
    def fake_time_graph(fns, device, reps):
        outs = [f() for f in fns]
        return 1.0, len(fns), 1, outs[0]

    monkeypatch.setattr(runner, "time_graph", fake_time_graph)
    monkeypatch.setattr(inputs, "MAX_ROTATION", 3)  # a tiny case would otherwise rotate 64 copies
    shape = shapes.make_shape(2, (300, 1000), 4, 2, 64, page_size=16)
    case = inputs.build_case(shape, torch.bfloat16, "cpu")
    ref = check.build_reference(case)
    row = dict.fromkeys(report.FIELDS, None)
    row["note"] = ""
    cfg = runner.Config(device=torch.device("cpu"), suite="quick", reps=1)
    assert runner.graph_capture(case, ref, registry.make("splitkv-torch"), cfg, row)
    assert row["graph_plan"].startswith("DecodePlan"), row
    assert row["graph_us"] == 1.0 and row["graph_calls"] == 3
    assert row["graph_rel_err"] < report.ERR_WARN and not report.err_flag(row)


def test_graph_rows_keep_the_fastest_capture_and_check_every_output(monkeypatch):
    """runner.GRAPH_CAPTURES fresh captures per graph row: the fastest one's time, the worst error."""
    times, outs = iter([2.0, 1.0]), []

    def fake_time_graph(fns, device, reps):
        o = fns[0]()
        if not outs:
            o = o.clone().fill_(float("nan"))  # the first capture's output is wrong: the row must say so
        outs.append(o)
        return next(times), len(fns), 7, o

    monkeypatch.setattr(runner, "time_graph", fake_time_graph)
    monkeypatch.setattr(runner, "GRAPH_CAPTURES", 2)
    monkeypatch.setattr(inputs, "MAX_ROTATION", 2)
    case = inputs.build_case(shapes.make_shape(1, 300, 4, 2, 64), torch.bfloat16, "cpu")
    ref = check.build_reference(case)
    row = dict.fromkeys(report.FIELDS, None)
    row["note"] = ""
    cfg = runner.Config(device=torch.device("cpu"), suite="quick", reps=1)
    for _ in range(runner.GRAPH_CAPTURES):
        runner.graph_capture(case, ref, registry.make("splitkv-torch"), cfg, row)
    assert len(outs) == 2 and row["graph_us"] == 1.0 and row["graph_replays"] == 7
    assert row["graph_captures_us"] == [2.0, 1.0]
    assert math.isnan(row["graph_max_abs_err"])


def test_graph_captures_go_in_rounds_over_a_shapes_providers(monkeypatch):
    """runner.GRAPH_CAPTURES: capture 1 of every provider, then capture 2 of every provider, so no
    row holds only the captures taken first at its shape; a row whose capture failed takes no more."""
    order, failing = [], set()

    def fake_capture(case, ref, p, cfg, row):
        order.append(p.name)
        return p.name not in failing

    monkeypatch.setattr(runner, "_graphs", lambda case, p, cfg, row: True)
    monkeypatch.setattr(runner, "graph_capture", fake_capture)
    providers = [registry.make("splitkv-torch"), registry.make("splitkv-torch-noplan")]
    cfg = runner.Config(device=torch.device("cpu"), suite="quick", reps=1, host=False)
    rows = runner.run([shapes.make_shape(1, 300, 4, 2, 64)], providers, cfg)
    assert [r["provider"] for r in rows] == ["splitkv-torch", "splitkv-torch-noplan"]
    assert order == ["splitkv-torch", "splitkv-torch-noplan"] * runner.GRAPH_CAPTURES
    order.clear()
    failing.add("splitkv-torch")
    runner.run([shapes.make_shape(1, 300, 4, 2, 64)], providers, cfg)
    assert order == ["splitkv-torch"] + ["splitkv-torch-noplan"] * runner.GRAPH_CAPTURES


def test_rows_measured_before_a_crash_are_written(tmp_path, monkeypatch):
    calls = []
    real = runner.measure

    def flaky(*args, **kw):
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(runner, "measure", flaky)
    out = tmp_path / "partial.json"
    with pytest.raises(RuntimeError):
        cli.main(["--quick", "--device", "cpu", "--no-progress", "--reps", "1",
                  "--shapes", "b1-l256-*,b2-l256-*", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 2 and "illegal memory access" in doc["meta"]["incomplete"]


def test_headline_suite_covers_peers_md_and_the_ragged_batch():
    suite = shapes.suite("headline")
    names = [s.name for s in suite]
    assert len(names) == len(set(names)) == 14 + 8 + 3 + 6  # + the fp8 rows
    for B, L, Hq, Hkv in shapes.PEERS_MD_SDPA:
        assert shapes.make_shape(B, L, Hq, Hkv).name in names
    for B, L, Hq, Hkv in shapes.PEERS_MD_PAGED:
        assert shapes.make_shape(B, L, Hq, Hkv, page_size=16).name in names
    geo, ragged, fills = [s for s in suite if not s.uniform]
    assert list(geo.seqlens) == list(shapes.spread_lengths(16, 1024, 131072)) and geo.page_size == 16
    assert list(ragged.seqlens) == torch.linspace(1024, 131072, 16).int().tolist()
    assert list(fills.seqlens) == list(shapes.spread_lengths(32, 1024, 131072)) and fills.page_size == 16
    assert (ragged.batch, ragged.num_q_heads, ragged.num_kv_heads, ragged.head_dim, ragged.page_size) == (
        16, 32, 8, 128, 16)
    assert ragged.name == "b16-ragged1k-128k-lin-h32x8-d128-paged16"
    full = [s.name for s in shapes.full_suite()]
    assert ragged.name in full and len(full) == len(set(full))  # distinct from the geometric spread


def test_fp8_rows_count_one_byte_per_kv_value_and_check_against_the_scaled_reference(quick_run):
    """fp8 rows: K/V stored in e4m3, bytes counted at one per K/V value, splitkv checked against the
    reference of the dequantised cache with the rows' scales (a dropped scale fails the row), SDPA
    n/a; the fp8 suite pairs every shape with its bf16 twin."""
    _, _, doc = quick_run
    (s,) = [s for s in shapes.quick_suite() if s.kv_dtype]
    assert s.name.endswith("-fp8e4m3")
    bf16_twin = shapes.make_shape(s.batch, s.seqlens[0], s.num_q_heads, s.num_kv_heads, s.head_dim,
                                  page_size=s.page_size)
    assert s.kv_bytes(2) * 2 == bf16_twin.kv_bytes(2)
    rows = {r["provider"]: r for r in doc["rows"] if r["shape"] == s.name}
    assert rows["splitkv-torch"]["status"] == "ok" and rows["splitkv-torch"]["rel_err"] < 1e-2
    assert rows["sdpa-flash"]["status"] == "n/a"
    case = inputs.build_case(s, torch.bfloat16, "cpu")
    assert case.base.k_cache.dtype == torch.float8_e4m3fn and case.kv_kwargs == dict(k_scale=0.5, v_scale=2.0)
    ref = check.build_reference(case)
    import splitkv

    ts = case.base
    o = splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, block_table=ts.block_table, backend="torch",
                       **case.kv_kwargs)
    assert ref.error(o)[1] < 1e-2
    wrong = splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, block_table=ts.block_table,
                           backend="torch", k_scale=0.5, v_scale=1.0)
    assert ref.error(wrong)[1] > 0.1
    fp8 = shapes.suite("fp8")
    assert len(fp8) == 12 and sum(bool(x.kv_dtype) for x in fp8) == 6
    assert all(x in shapes.headline_suite() for x in fp8 if x.kv_dtype)


def test_variant_rows_pass_their_variant_and_count_the_window(quick_run):
    """Variant rows: decode and the reference both get the variant (a call without it fails the
    check), peers without it are n/a, and a window's bytes are the keys it shows."""
    _, _, doc = quick_run
    (s,) = [s for s in shapes.quick_suite() if not s.plain]
    assert s.name.endswith("-win200-softcap20-sinks")
    rows = {r["provider"]: r for r in doc["rows"] if r["shape"] == s.name}
    assert rows["splitkv-torch"]["status"] == "ok" and rows["splitkv-torch"]["rel_err"] < 1e-2
    assert rows["sdpa-flash"]["status"] == "n/a"
    assert s.visible == (201, 201) and s.kv_bytes(2) == 2 * 201 * 2 * 2 * 64 * 2
    case = inputs.build_case(s, torch.bfloat16, "cpu")
    ref = check.build_reference(case)
    import splitkv

    ts = case.base
    kw = case.call_kwargs
    assert set(kw) == {"window_size", "softcap", "sinks"}
    o = splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, backend="torch", **kw)
    err = ref.error(o)[1]
    assert err < 1e-2
    for drop in kw:
        wrong = splitkv.decode(ts.q, ts.k_cache, ts.v_cache, ts.cache_seqlens, backend="torch",
                               **{k: v for k, v in kw.items() if k != drop})
        assert ref.error(wrong)[1] > 3 * err, drop
    names = [x.name for x in shapes.suite("variants")]
    assert len(names) == len(set(names)) == 24 and "b1-l128k-h32x8-d128-paged16-win4095" in names
    assert "b1-l32k-h32x8-d256-paged16" in names  # issue 13: D 256 at B=1 next to FlashInfer


def test_noplan_provider_mode():
    p = registry.make("splitkv-auto-noplan")
    assert isinstance(p, SplitKV) and p.backend == "auto" and p.noplan and p.name == "splitkv-auto-noplan"
    assert p.graphable  # a plain decode is capturable (after a warm-up call on the capture stream)
    q = registry.make("splitkv-auto")
    assert not q.noplan and q.graphable
    assert not registry.make("splitkv-torch-noplan").graphable
    assert registry.expand("splitkv", ("triton", "cutlass")) == [
        "splitkv-triton", "splitkv-triton-noplan", "splitkv-cutlass", "splitkv-cutlass-noplan"]
    with pytest.raises(ValueError):
        registry.make("splitkv-nope-noplan")
    # a no-plan call gives the same output as the plan-reused one
    shape = shapes.make_shape(2, (100, 300), 4, 2, 64, page_size=16)
    case = inputs.build_case(shape, torch.float32, "cpu", seed=3)
    a = registry.make("splitkv-torch-noplan").session(case, graph=False).bind(case.base)()
    b = registry.make("splitkv-torch").session(case, graph=False).bind(case.base)()
    torch.testing.assert_close(a, b)


def test_time_host_counts_calls():
    n = []
    us, calls = time_host(lambda: n.append(1), torch.device("cpu"), calls=5, loops=2)
    assert us > 0 and calls == 5 and len(n) == 1 + 2 * 5  # one warm-up call, then the loops
    us, calls = time_host(lambda: None, torch.device("cpu"))
    assert us >= 0 and calls >= 2


def _gpu_run_bench_default() -> str:
    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    m = re.search(r'^BENCH_DEFAULT="([^"]+)"', text, re.M)
    assert m, "gpu_run.sh defines BENCH_DEFAULT"
    assert "${BENCH_ARGS:-$BENCH_DEFAULT}" in text
    return m.group(1)


def test_gpu_run_bench_command_selects_the_headline_suite(capsys):
    args = _gpu_run_bench_default().split()
    assert args[:2] == ["--suite", "headline"]
    provs = args[args.index("--providers") + 1].split(",")
    assert set(provs) == {"splitkv-auto-noplan", "splitkv-auto", "sdpa-cudnn", "sdpa-flash", "flashinfer"}
    assert cli.main(args + ["--list", "--device", "cpu"]) == 0
    listed = capsys.readouterr().out
    assert "b16-ragged1k-128k-lin-h32x8-d128-paged16" in listed and "b1-l4k-h32x8-d128" in listed
    assert "splitkv-auto-noplan" in listed


def test_host_breakdown_runs_and_reports_errors(tmp_path, capsys):
    from splitkv.bench import host

    rc = cli.main(["--host-breakdown", "--device", "cpu", "--host-shape", "1,64,2,1,64", "--reps", "2",
                   "--backends", "torch,bogus", "--json", str(tmp_path / "host.json"),
                   "--markdown", str(tmp_path / "host.md")])
    assert rc == 0
    doc = json.loads((tmp_path / "host.json").read_text())
    res = doc["results"]
    assert doc["schema"] == host.SCHEMA and doc["meta"]["shape"]["L"] == 64
    assert doc["meta"]["command"].startswith("python -m splitkv bench --host-breakdown")
    for key in ("[torch] decode() no plan", "[torch] decode(plan=p)", "[torch] decode(out=) no plan",
                "[torch] decode(plan=p, out=, return_lse=True)", "[stage] validate.check_keyed (signature lookup)",
                "[stage] torch.empty_like(q)", "[peer] SDPA flash"):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])
    assert res["[bogus] (all entries)"].startswith("skipped:")
    assert res["[peer] SDPA cuDNN"].startswith("skipped:")
    assert "HOST [torch] decode() no plan" in capsys.readouterr().out
    assert "| [torch] decode(plan=p) |" in (tmp_path / "host.md").read_text()
    with pytest.raises(SystemExit, match="--host-shape"):
        cli.main(["--host-breakdown", "--device", "cpu", "--host-shape", "1,64,3,2,64"])


def test_cpu_suite_is_the_cpu_demo_shapes():
    from splitkv import demo

    want = {(B, Hq, Hkv, D, L) for B, Hq, Hkv, D, L, _, names in demo._cases(torch.device("cpu")) if names == ["torch"]}
    got = [(s.batch, s.num_q_heads, s.num_kv_heads, s.head_dim, s.max_seqlen) for s in shapes.suite("cpu")]
    assert set(got) == want and any(s.paged for s in shapes.suite("cpu"))


def test_tile_sweep_forces_each_tile_and_reports_it(tmp_path, monkeypatch):
    """--sweep-tiles: one plan per forced tile (heuristics.tile_override), each timed; the markdown
    carries the table and the command; a bad tile list is a clear error naming the flag."""
    from splitkv.bench import sweep as sweep_mod

    launched = []
    real_time = sweep_mod._Timer.time

    def spy(self, p):
        launched.append((p.tile.block_n, p.tile.num_warps, p.tile.num_stages, p.rule.block_n))
        return real_time(self, p)

    monkeypatch.setattr(sweep_mod._Timer, "time", spy)
    md = tmp_path / "t.md"
    rc = cli.main(["--quick", "--device", "cpu", "--no-progress", "--providers", "splitkv-torch", "--shapes",
                   "b1-l1k*", "--sweep-tiles", "32x2x2,128x8x4", "--sweep-only", "--reps", "1",
                   "--markdown", str(md), "--json", str(tmp_path / "t.json")])
    assert rc == 0
    assert launched[1:-1] == [(32, 2, 2, 32), (128, 8, 4, 128)]  # the split rule sizes chunks with the forced block_n
    assert launched[-1] == launched[0]  # the planner's tile is timed first and again last (the least counts)
    (row,) = json.loads((tmp_path / "t.json").read_text())["sweep"]
    assert row["sweep"] == "tiles" and [c["tile"] for c in row["curve"]] == ["32x2x2", "128x8x4"]
    text = md.read_text()
    assert "## Tile sweep" in text and "--sweep-tiles 32x2x2,128x8x4" in text
    launched.clear()  # an fp8 row: the plans and decodes of the sweep carry the cache's scales
    assert cli.main(["--quick", "--device", "cpu", "--no-progress", "--providers", "splitkv-torch", "--shapes",
                     "*-fp8e4m3", "--sweep-tiles", "32x2x2", "--sweep-only", "--reps", "1"]) == 0
    assert [t[:2] for t in launched[1:-1]] == [(32, 2)]  # (a paged row: the rule adds stages)
    with pytest.raises(SystemExit, match="--sweep-tiles"):
        cli.main(["--quick", "--device", "cpu", "--no-progress", "--providers", "splitkv-torch",
                  "--sweep-tiles", "64x4", "--sweep-only"])


def test_tile_override_is_scoped_and_checked():
    from splitkv import heuristics as H

    base = H.tile_config(128, 4)
    with H.tile_override(block_n=32, num_stages=5):
        t = H.tile_config(128, 4)
        assert (t.block_n, t.num_warps, t.num_stages) == (32, base.num_warps, 5)
        assert H.cutlass_tile(128, True, False) == (32, 5)
    assert H.tile_config(128, 4) == base and H.cutlass_tile(128, True, False) == (64, 3)
    with pytest.raises(ValueError, match="block_n"):
        with H.tile_override(block_n=0):
            pass
    assert H.fused_merge(False) is False
    with H.tile_override(fused_merge=True):
        assert H.fused_merge(False) is True and H.tile_config(128, 4) == base
    from splitkv.bench.sweep import parse_tiles

    assert parse_tiles("64x4x3,128x4x2:fused,64x4x3:merge", "triton") == [(64, 4, 3, None), (128, 4, 2, True),
                                                                          (64, 4, 3, False)]
    with pytest.raises(ValueError, match=":fused or :merge"):
        parse_tiles("64x4x3:both", "triton")
