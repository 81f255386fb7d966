"""Packaging checks cheap enough for the CPU suite: the installed distribution's metadata (an
editable install in the checkout, the built wheel in CI's second pass) carries splitkv.__version__,
the SPDX license and the LICENSE file, and the CLI reports the same version. Skipped when splitkv
is imported from a path without being installed (no metadata to check)."""

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

import splitkv

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist():
    try:
        return md.distribution("splitkv")
    except md.PackageNotFoundError:
        pytest.skip("splitkv is not installed (imported from a path): no distribution metadata to check")


def test_metadata_version_is_the_package_version(dist):
    assert dist.version == splitkv.__version__, (
        f"installed metadata says {dist.version}, splitkv.__version__ is {splitkv.__version__}: reinstall")


def test_license_is_declared_and_ships(dist):
    meta = dist.metadata
    assert meta.get("License-Expression") == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    # a wheel keeps it in .dist-info/licenses/, an editable install's egg-info names it at the root
    shipped = [f for f in (dist.files or []) if f.name == "LICENSE"]
    assert shipped, "LICENSE is not among the distribution's files"
    text = shipped[0].read_text()
    assert "Apache License" in text and "Version 2.0" in text


def test_cli_version_prints_the_package_version(dist):
    res = subprocess.run([sys.executable, "-m", "splitkv", "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"splitkv {splitkv.__version__}"


def test_every_public_name_has_an_api_reference_entry():
    """docs/api.md (built by mkdocs --strict in CI) documents every name of splitkv.__all__."""
    api = (ROOT / "docs" / "api.md").read_text()
    missing = []
    for name, (mod, attr) in splitkv._EXPORTS.items():
        target = f"splitkv.{mod}" + (f".{attr}" if attr else "")
        if f"::: {target}\n" not in api:
            missing.append(f"{name} ({target})")
    assert not missing, f"public names without an API reference entry: {missing}"


def _public_callables():
    import importlib
    import inspect

    out = []
    for name, (mod, attr) in splitkv._EXPORTS.items():
        obj = importlib.import_module(f"splitkv.{mod}")
        obj = getattr(obj, attr) if attr else obj
        if inspect.ismodule(obj):
            out += [(f"{mod}.{n}", f) for n, f in vars(obj).items()
                    if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == obj.__name__]
        elif inspect.isclass(obj):
            out += [(f"{name}.{n}", f) for n, f in vars(obj).items()
                    if (not n.startswith("_") or n == "__init__") and inspect.isfunction(f)]
        else:
            out.append((name, obj))
    return out


def test_public_functions_are_type_hinted():
    import inspect

    bad = []
    for name, f in _public_callables():
        sig = inspect.signature(f)
        params = [p for p, v in sig.parameters.items()
                  if v.annotation is inspect.Parameter.empty and p not in ("self", "cls")]
        no_return = sig.return_annotation is inspect.Signature.empty
        if params or no_return:
            bad.append(f"{name}: {params or ''}{' no return type' if no_return else ''}")
    assert not bad, bad


def test_cited_result_files_exist():
    """Every results/<dated run>/... file that code comments or docs cite is in the repository."""
    import glob
    import re

    pat = re.compile(r"results/(20\d\d-\d\d-\d\d[\w.-]*/[\w./*-]+)")
    sources = [*ROOT.glob("splitkv/**/*.py"), *ROOT.glob("*.md"), *ROOT.glob("benchmarks/*.md"),
               *ROOT.glob("benchmarks/*.py")]
    missing, found = [], 0
    for src in sources:
        for ref in pat.findall(src.read_text()):
            found += 1
            ref = ref.rstrip(".,)")
            if not glob.glob(str(ROOT / "benchmarks" / "results" / ref)):
                missing.append(f"{src.relative_to(ROOT)}: {ref}")
    assert found and not missing, missing
