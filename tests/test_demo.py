"""`python -m splitkv demo` on the CPU: the table a user sees (eager, no plan; graph and cuDNN columns
are GPU-only) and its check against the reference. CI also runs the full demo."""

import pytest
import torch

from splitkv import demo


def test_measure_case_checks_against_the_reference():
    rows, ok, notes = demo.measure_case(1, 4, 2, 64, 300, torch.bfloat16, ["torch"], torch.device("cpu"))
    assert ok and not notes
    (row,) = rows
    assert row[0] == "torch" and row[4] == "300" and row[-1].endswith("ok[/]")
    assert row[6] != "—" and "(" in row[6]  # eager µs (bandwidth)
    assert row[7:10] == ["—", "—", "—"]  # graph and cuDNN columns: GPU only


def test_demo_main_prints_the_columns(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_cases", lambda device: [(1, 4, 2, 64, 256, torch.bfloat16, ["torch"])])
    import splitkv.demo_llama

    seen = []
    monkeypatch.setattr(splitkv.demo_llama, "run", lambda console, device, tf_compile: seen.append(tf_compile) or True)
    assert demo.main([]) == 0 and demo.main(["--tf-compile"]) == 0 and seen == [False, True]
    out = capsys.readouterr().out
    for col in ("eager, no plan", "graph, plan", "cuDNN eager", "cuDNN graph"):
        assert col in out
    assert "all results match the reference" in out


def test_cli_version_unknown_command_and_demo_help(capsys):
    from splitkv.__main__ import main

    assert main(["--version"]) == 0 and "splitkv" in capsys.readouterr().out
    assert main(["no-such-command"]) == 2 and "unknown command 'no-such-command'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # --help describes the demo instead of running it
        main(["demo", "--help"])
    assert e.value.code == 0 and "fp64 reference" in capsys.readouterr().out


def test_a_failing_transformers_compile_is_reported_not_raised(monkeypatch):
    """demo --tf-compile: transformers' compiled StaticCache is a peer; its failure is a message."""
    import splitkv.demo_llama as D

    def boom(*a, **k):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(D, "_tf_generate", boom)
    assert D._tf_compiled_ms(None, None, 4, torch.device("cpu")) == "RuntimeError: no compiler"
