"""splitkv.pngs.save_png: every figure the project writes goes through it."""

import io

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from splitkv.pngs import save_png


def _figure():
    fig = Figure(figsize=(4, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [0, 2, 1], color="#d62728", lw=3)
    ax.set_title("a line")
    return fig


def test_a_figure_is_written_as_a_smaller_palette_png_with_its_colours(tmp_path):
    fig = _figure()
    full = io.BytesIO()
    fig.savefig(full, format="png", dpi=110)
    path = save_png(fig, tmp_path / "sub" / "f.png")
    with Image.open(path) as im, Image.open(full) as ref:
        assert im.mode == "P" and im.size == ref.size
        palette = {c for _, c in im.convert("RGB").getcolors(maxcolors=256)}
    assert (214, 39, 40) in palette  # the line's red survives the palette
    assert path.stat().st_size < len(full.getvalue())


def test_a_palette_outside_a_pngs_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match="colors"):
        save_png(_figure(), tmp_path / "f.png", colors=1)
