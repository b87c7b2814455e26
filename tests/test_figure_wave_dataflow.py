"""Chapter 2's dataflow figure and chapter 0's cache-layout figure draw, labelled, legended,
within GitHub's column; the dataflow's lane arithmetic is the chapter's (each element of K, the
scores, P, V and O marked for the chosen lane: the counts the chapter states)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pa_tile import figures  # noqa: E402


def _check_drawn(fig):
    assert fig.get_size_inches()[0] <= figures.WIDTH + 1e-9, "wider than GitHub's column"
    fig.canvas.draw()
    assert fig.legends, "no legend"
    for ax in fig.axes:
        if ax.get_visible() and ax.axison:
            assert ax.get_title() and (ax.get_xlabel() or ax.get_ylabel()), "an unlabelled panel"


@pytest.mark.parametrize("lane", [0, 21, 63])
def test_wave_dataflow_draws_and_marks_the_lane(lane):
    fig = figures.wave_dataflow(lane)
    try:
        _check_drawn(fig)
        titles = [ax.get_title() for ax in fig.axes]
        assert any(f"lane {lane} " in t for t in titles), titles
        # every data panel marks exactly the chosen lane's elements, one patch each
        counts = [sum(1 for p in ax.patches) for ax in fig.axes if ax.axison]
        # K: 4 tokens x 32 channels; scores and P: 16 each; V: 8 channels x 16 tokens; O: 8 x 4
        assert counts == [128, 16, 16, 128, 32], counts
    finally:
        plt.close(fig)


def test_cache_layouts_outlines_every_chunk():
    t, d = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    chunks = {"K plain": (t * 32 + d) // 16, "V plain": (d * 32 + t) // 16}
    fig = figures.cache_layouts(chunks)
    try:
        _check_drawn(fig)
        visible = [ax for ax in fig.axes if ax.get_visible()]
        assert [len(ax.patches) for ax in visible] == [64, 64]  # one outline per 16-byte chunk
        assert "128-byte cache line" in fig.legends[0].get_title().get_text()
    finally:
        plt.close(fig)
