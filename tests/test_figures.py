"""Every figure of the walkthrough draws on an Agg canvas, with labelled axes and a legend."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pa_tile import figures  # noqa: E402

STAGES = ("s1", "s2", "s5")
ARCHS = ("gfx942", "gfx950")


def _static():
    rows = []
    for si, st in enumerate(STAGES):
        for arch in ARCHS:
            for bs in (16, 64):
                rows.append(dict(stage=st, arch=arch, block_size=bs, vgpr_unified=100 + 10 * si, agpr=8 * (si == 0),
                                 waves_per_simd=4, lds_bytes=1024 * (3 - si), loop_instructions=300 - 20 * si,
                                 loop_families=dict(buffer=16, mfma=32, valu=100 + si, barrier=2 - si // 2),
                                 load_widths=dict(buffer=dict(dwordx4=16 + si, dword=2), ds=dict(b128=4))))
    return rows


def _trace():
    return [dict(stage=st, arch=arch, k=dict(bytes_per_load=1024, coalescing=1.0 - 0.1 * si),
                 v=dict(bytes_per_load=512, coalescing=0.9), lds_max_degree=1 + si, lds_conflict_cycles_per_tile=50.0,
                 families_per_tile=dict(buffer=16.0, mfma=32.0, valu=120.0))
            for si, st in enumerate(STAGES) for arch in ARCHS]


def _chunks():
    t, d = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    return {"K plain": (t * 32 + d) // 16, "V plain": (d * 32 + t) // 16}


def _shapes():
    from pa_tile.perf import roofline

    return roofline.upstream_shapes(batches=(1, 16, 256), contexts=(129, 2048, 16384))


def _margins():
    rows = [dict(arch=arch, head_dim=hd, query_len=ql, scales=sc, vgpr=100 + hd // 2 + 10 * ql, upstream_vgpr=130 + hd // 2,
                 waves=4 - ql // 4, upstream_waves=3) for arch in ARCHS for hd in (64, 128) for ql in (1, 4)
            for sc in ("tensor", "token")]
    return figures.upstream_margins(rows, [("VGPR", "vgpr", "upstream_vgpr", False), ("waves", "waves", "upstream_waves", True)],
                                    color="arch", marker="scales", title="t")


lanes = np.arange(64)
CASES = {
    "decode_floor": lambda: figures.decode_floor([129, 2048], {(1, "MI300X"): [1.0, 9.0], (1, "MI355X"): [0.6, 6.0],
                                                               (16, "MI300X"): [9.0, 90.0]}),
    "mfma_atom": lambda: figures.mfma_atom(lanes[:32].reshape(2, 16).repeat(8, 0).repeat(2, 1), lanes.reshape(4, 16)),
    "cache_layouts": lambda: figures.cache_layouts(_chunks()),
    "wave_split": lambda: figures.wave_split(),
    "mfma_ownership": lambda: figures.mfma_ownership(chunk=1, d_chunk=2),
    "softmax_butterfly": lambda: figures.softmax_butterfly(head=3),
    "lane_lines": lambda: figures.lane_lines({"K plain": lanes * 128, "K blocked": lanes * 16}, ksteps=True),
    "lds_banks": lambda: figures.lds_banks((4, 5)),
    "phase_timeline": lambda: figures.phase_timeline(m_tiles=3, tiles=1),
    "head_dim_split_timeline": lambda: figures.head_dim_split_timeline(m_tiles=5, group=2),
    "head_dim_split_timeline_v_with_k": lambda: figures.head_dim_split_timeline(m_tiles=2, v_with_k=True),
    "head_dim_split_dataflow": lambda: figures.head_dim_split_dataflow(head_dim=256),
    "traffic_bars": lambda: figures.traffic_bars(["a", "b"], {"x": [1.0, 2.5], "y": [0.9, 1.0]}, title="t"),
    "split_k": lambda: figures.split_k([1, 300, 2600], 4),
    "roofline": lambda: figures.roofline(_shapes()),
    "static_facts": lambda: figures.static_facts(_static(), list(STAGES), [(a, b) for a in ARCHS for b in (16, 64)]),
    "trace_facts": lambda: figures.trace_facts(_trace(), list(STAGES), ARCHS),
    "upstream_margins": _margins,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_figure_draws_with_legend_and_labels(name):
    fig = CASES[name]()
    try:
        assert fig.get_size_inches()[0] <= figures.WIDTH + 1e-9, "wider than GitHub's column"
        fig.canvas.draw()  # Agg: lays out every artist, so a bad argument fails here
        axes = [a for a in fig.axes if a.get_visible()]
        assert axes
        assert fig.legends or any(a.get_legend() is not None for a in axes), "no legend"
        for a in axes:
            assert a.get_title() or fig._suptitle is not None, "an untitled panel"
            assert a.get_xlabel() or a.get_ylabel() or a.get_xticklabels(), "unlabelled axes"
    finally:
        plt.close(fig)


def test_lds_banks_stride_5_has_no_conflict():
    fig = figures.lds_banks((4, 5))
    try:
        titles = [a.get_title() for a in fig.axes]
        assert "8 banks, worst 2-way" in titles[0] and "16 banks, worst 1-way" in titles[1]
    finally:
        plt.close(fig)


def test_lane_lines_counts_lines_and_lane_groups():
    from pa_tile.emu.memory import LINE_BYTES

    assert figures.LINE_BYTES == LINE_BYTES  # the figure's line is the trace's
    # stage 3's K load (lane c of group g: token row c, bytes 16g..): 16 rows, 4 groups' bytes in each;
    # a 4-lane addresser group spans 4 rows. Blocked: each 4-lane group reads 64 contiguous bytes
    plain = (lanes % 16) * 128 + (lanes // 16) * 16
    blocked = (lanes // 4) * 256 + (lanes % 4) * 16
    fig = figures.lane_lines({"plain": plain, "blocked": blocked})
    try:
        titles = [a.get_title() for a in fig.axes]
        assert titles[0] == "plain: 16 lines, 64 (4-lane group, line) pairs"
        assert titles[1] == "blocked: 16 lines, 16 (4-lane group, line) pairs"
    finally:
        plt.close(fig)


def test_upstream_margins_counts_configurations_that_meet_upstream():
    fig = _margins()  # registers: 20 fewer than upstream at query_len 1, 10 more at 4
    try:
        titles = [a.get_title() for a in fig.axes]
        assert titles[0] == "VGPR: 8 of 16 configurations meet or beat upstream (margin -10 to 20)"
        assert titles[1] == "waves: 16 of 16 configurations meet or beat upstream (margin 0 to 1)"
        ticks = [t.get_text() for t in fig.axes[-1].get_xticklabels()]
        assert ticks == [f"head_dim {hd}\nquery_len {ql}" for hd in (64, 128) for ql in (1, 4)]
        # a point below upstream is drawn hollow
        rows = [dict(head_dim=64, query_len=1, scales="tensor", vgpr=v, upstream_vgpr=100) for v in (90, 110)]
        short = figures.upstream_margins(rows, [("VGPR", "vgpr", "upstream_vgpr", False)])
        try:
            assert short.axes[0].get_title().startswith("VGPR: 1 of 2 configurations")
            hollow = [c.get_facecolors().size == 0 or c.get_facecolors()[0][3] == 0 for c in short.axes[0].collections]
            assert hollow == [False, True]
        finally:
            plt.close(short)
    finally:
        plt.close(fig)
