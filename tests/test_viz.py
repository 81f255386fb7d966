"""splitkv.viz: partial-LSE heat maps through the debug hook, anomaly flags, the heatmap CLI."""

import math

import pytest
import torch
from helpers import assert_drawn_png

import splitkv
from splitkv import viz

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _inputs(B=2, L=700, hq=4, hkv=2, D=64, q_len=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, q_len, hq, D, generator=g)
    k = torch.randn(B, L, hkv, D, generator=g)
    v = torch.randn(B, L, hkv, D, generator=g)
    return q, k, v, torch.full((B,), L, dtype=torch.int32)


def test_planted_nan_split_is_flagged_in_figure_and_stdout(tmp_path, capsys):
    q, k, v, seqlens = _inputs()
    p = splitkv.plan(seqlens, 4, 2, 64, num_splits=3)
    viz.plant_nan(k, seqlens, None, p, request=1, split=1)
    out = tmp_path / "lse.png"
    rep = viz.lse_heatmap(q, k, v, seqlens, plan=p, backend="torch", out=out)
    assert rep.lse.shape == (3, 2, 4, 1)
    flagged = {(a.request, a.split, a.head, a.kind) for a in rep.anomalies}
    assert flagged == {(1, 1, h, "nan") for h in range(4)}  # every head of that split, nothing else
    printed = capsys.readouterr().out
    assert "4 anomalies" in printed and "request 1 split 1 head 0 query 0: nan" in printed
    assert_drawn_png(out)


def test_clean_decode_has_no_anomalies_and_lse_matches_splits():
    q, k, v, seqlens = _inputs(L=1000, q_len=3)
    rep = viz.lse_heatmap(q, k, v, seqlens, num_splits=4, backend="torch", echo=False)
    assert rep.anomalies == []
    # merging the partials gives the reference lse: logsumexp over splits of the partial lse
    from splitkv.reference import decode_reference

    _, ref_lse = decode_reference(q, k, v, seqlens)
    merged = torch.logsumexp(rep.lse.double(), dim=0)  # [B, Hq, Sq]
    torch.testing.assert_close(merged, ref_lse, rtol=0, atol=1e-4)


def test_split_keys_cover_each_query_exactly_once():
    L, q_len = torch.tensor([37, 300], dtype=torch.int32), 4
    n, c = torch.tensor([3, 5]), torch.tensor([16, 64])
    keys = viz.split_keys(L, n, c, 5, q_len, causal=True)  # [S, B, Sq]
    for b in range(2):
        for t in range(q_len):
            assert int(keys[:, b, t].sum()) == int(L[b]) - q_len + t + 1
    assert keys[3:, 0].sum() == 0  # splits past num_splits show nothing
    assert int(keys[2, 0, 3]) == 37 - 32  # the last split runs on to the length


def test_find_anomalies_kinds():
    S, B, H, T = 4, 1, 2, 1
    lse = torch.full((S, B, H, T), 5.0)
    keys = torch.full((S, B, T), 100)
    keys[3] = 0
    lse[3] = -math.inf  # empty split: -inf is correct
    lse[1, 0, 0, 0] = -math.inf  # non-empty split with -inf
    lse[2, 0, 1, 0] = 5.0 + 20.0  # far above its neighbours
    lse[0, 0, 1, 0] = math.inf
    found = {(a.split, a.head, a.kind) for a in viz.find_anomalies(lse, keys, torch.tensor([4]))}
    assert found == {(1, 0, "-inf"), (2, 1, "outlier"), (0, 1, "inf")}
    lse[3, 0, 0, 0] = 1.0  # a finite value in an empty split
    kinds = {a.kind for a in viz.find_anomalies(lse, keys, torch.tensor([4]))}
    assert "empty-finite" in kinds
    only_first = viz.find_anomalies(lse, keys, torch.tensor([1]))  # splits past num_splits are not read
    assert {(a.split, a.kind) for a in only_first} == {(0, "inf")}


def test_heatmap_cli_with_saved_inputs(tmp_path, capsys):
    q, k, v, seqlens = _inputs(B=1, L=600)
    path = tmp_path / "inputs.pt"
    torch.save({"q": q.bfloat16(), "k_cache": k.bfloat16(), "v_cache": v.bfloat16(),
                "cache_seqlens": seqlens}, path)
    png = tmp_path / "h.png"
    base = ["--out", str(png), "--inputs", str(path), "--device", "cpu", "--num-splits", "3"]
    assert viz.heatmap_main(base) == 0
    assert_drawn_png(png)
    rc = viz.heatmap_main(base + ["--plant-nan", "0:2", "--strict"])
    assert rc == 1 and "planted NaN" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        torch.save({"q": q}, path)
        viz.heatmap_main(["--out", str(png), "--inputs", str(path), "--device", "cpu"])


def test_heatmap_cli_with_a_paged_cache(tmp_path):
    """--inputs with a block_table (as the README documents): the plan is made for a paged cache."""
    g = torch.Generator().manual_seed(4)
    pool = torch.randn(40, 16, 2, 64, generator=g).bfloat16()
    path = tmp_path / "paged.pt"
    torch.save({"q": torch.randn(2, 1, 8, 64, generator=g).bfloat16(), "k_cache": pool, "v_cache": pool.clone(),
                "cache_seqlens": torch.tensor([300, 45], dtype=torch.int32),
                "block_table": torch.randperm(40, generator=g).reshape(2, 20).int()}, path)
    png = tmp_path / "p.png"
    assert viz.heatmap_main(["--out", str(png), "--inputs", str(path), "--device", "cpu"]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("flags", [["--heads", "8"], ["--plant-nan", "x:y"], ["--plant-nan", "5:0"],
                                   ["--requests", "7"], ["--batch", "0"], ["--inputs", "/no/such.pt"],
                                   ["--outlier-nats", "nan"], ["--plant-nan", "0:99"], ["--head-dim", "7"],
                                   ["--q-len", "0"], ["--heads", "3/2"]], ids=str)
def test_heatmap_cli_bad_flags_are_usage_errors(tmp_path, flags, capsys):
    base = ["--out", str(tmp_path / "x.png"), "--device", "cpu", "--seqlen", "64", "--heads", "4/2", "--head-dim", "64"]
    with pytest.raises(SystemExit) as e:
        viz.heatmap_main(base + flags)  # argparse: the last of a repeated flag wins
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err  # argparse's error, naming the flag


@pytest.mark.parametrize("flags", [["--backend", "bogus"], ["--out", "/proc/no/h.png"]], ids=str)
def test_heatmap_cli_errors_of_the_run_are_one_line(tmp_path, flags, capsys):
    base = ["--out", str(tmp_path / "x.png"), "--device", "cpu", "--seqlen", "64", "--heads", "4/2", "--head-dim", "64"]
    with pytest.raises(SystemExit) as e:
        viz.heatmap_main(base + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("python -m")


def test_heatmap_requests_must_name_requests_of_the_batch(tmp_path):
    q, k, v = torch.randn(2, 1, 4, 64), torch.randn(2, 64, 2, 64), torch.randn(2, 64, 2, 64)
    sl = torch.tensor([64, 10], dtype=torch.int32)
    for bad in ([], [9], [-1]):
        with pytest.raises(ValueError, match="requests: expected a non-empty list"):
            viz.lse_heatmap(q, k, v, sl, out=tmp_path / "r.png", requests=bad, backend="torch", echo=False)


def test_heatmap_of_an_empty_cache(tmp_path):
    assert viz.heatmap_main(["--out", str(tmp_path / "e.png"), "--device", "cpu", "--seqlen", "0", "--heads", "4/2",
                             "--head-dim", "64"]) == 0


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if splitkv.backends.triton_available() else []))
def test_a_one_split_request_records_its_final_state(backend):
    """In a plan that splits, a request of one split is written straight to the output by the
    kernels: its recorded split 0 is that output, never stale workspace (the heat map reads it)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 1, 4, 32, generator=g).half()
    k, v = torch.randn(2, 3, 1500, 2, 32, generator=g).half().unbind(0)
    lens = torch.tensor([1500, 100, 0], dtype=torch.int32)
    with splitkv.debug.capture_partials() as recs:
        o, lse = splitkv.decode(q, k, v, lens, return_lse=True, backend=backend)
    rec = recs[0]
    assert rec.num_splits[0] > 1 and rec.num_splits[1:].tolist() == [1, 1]
    assert torch.equal(rec.lse_part[0, 1:], lse[1:].float())
    assert torch.equal(rec.o_part[0, 1:], o[1:].float().transpose(1, 2))
