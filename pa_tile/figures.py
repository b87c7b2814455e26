"""The walkthrough's figures: one function per picture, so a chapter's cell is one call.

Every function draws with matplotlib only, returns the ``Figure`` (the chapter shows it with
``plt.show()``) and is deterministic: no randomness, no timestamps. Sizes suit GitHub's
~900-pixel column (9 inches wide at 100 dpi, fonts of 8 points or more); colours come from the
Okabe-Ito palette (distinguishable with the common colour-vision deficiencies) or ``cividis``.

Nothing here imports a kernel chapter (``pa_tile.stages``): the chapters pass in what they
computed, and the lane/address arithmetic drawn here is the one the chapters' text states.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import numpy as np

__all__ = ["OKABE_ITO", "decode_floor", "cache_layouts", "mfma_atom", "wave_split", "mfma_ownership", "softmax_butterfly",
           "lane_lines", "lds_banks", "phase_timeline", "traffic_bars", "split_k", "roofline", "static_facts",
           "trace_facts", "partition_sweep", "kernel_map", "stage_predictions", "work_layouts", "schedule_predictions",
           "m_tile_predictions", "upstream_margins", "wave_dataflow", "head_dim_split_timeline", "head_dim_split_dataflow"]

#: Okabe & Ito's colour-blind-safe palette (black last: it is kept for text and markers)
OKABE_ITO = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#000000")
#: the palette without its yellow, which is too faint for lines on white
LINE_COLORS = tuple(c for c in OKABE_ITO if c != "#F0E442")
WIDTH = 9.0  # inches: GitHub's column at 100 dpi
FONT = 8


def _plt():
    import matplotlib.pyplot as plt

    return plt


def _style(ax, title=None, xlabel=None, ylabel=None):
    if title:
        ax.set_title(title, fontsize=FONT + 1)
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=FONT)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=FONT)
    ax.tick_params(labelsize=FONT)


def _patches(labels, colors, alpha=1.0):
    from matplotlib.patches import Patch

    return [Patch(facecolor=c, edgecolor="0.3", alpha=alpha, label=lab) for lab, c in zip(labels, colors)]


def _cmap(colors):
    from matplotlib.colors import ListedColormap

    return ListedColormap(list(colors))


def _label_lanes(ax, grid):
    """One label per lane, on the (rectangular) run of elements it holds, outlined in white."""
    from matplotlib.patches import Rectangle

    for lane in np.unique(grid):
        cells = np.argwhere(grid == lane)
        (i0, j0), (i1, j1) = cells.min(axis=0), cells.max(axis=0)
        ax.add_patch(Rectangle((j0 - 0.5, i0 - 0.5), j1 - j0 + 1, i1 - i0 + 1, fill=False, edgecolor="white", lw=1))
        ax.text((j0 + j1) / 2, (i0 + i1) / 2, str(lane), ha="center", va="center", fontsize=FONT)


# ---------------------------------------------------------------------------------------------
# chapter 00

def decode_floor(contexts: Sequence[int], floors: Mapping[tuple, Sequence[float]]):
    """Log-log decode time floor against context length: ``floors[(batch, gpu)]`` is one time
    (µs) per context. Colour = batch, line style = GPU."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6))
    batches = sorted({b for b, _ in floors})
    gpus = list(dict.fromkeys(g for _, g in floors))
    for (b, g), t in floors.items():
        ax.loglog(contexts, t, ("-", "--", ":")[gpus.index(g) % 3], marker="os^"[gpus.index(g) % 3], ms=3.5,
                  color=LINE_COLORS[batches.index(b) % len(LINE_COLORS)], label=f"batch {b}, {g}")
    _style(ax, "Decode time floor = K/V bytes / HBM bandwidth (8 KV heads, 64 q heads, head_dim 128)",
           "context length (tokens)", "time floor (µs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="colour: batch; line: GPU",
              title_fontsize=FONT)
    fig.tight_layout()
    return fig


def cache_layouts(chunks: Mapping[str, np.ndarray], chunk_bytes: int = 16, line_bytes: int = 128):
    """Where each (token, channel) byte of one page sits in memory, for each cache layout.

    ``chunks[name]`` is ``[tokens, channels]`` of ``chunk_bytes`` chunk indices in memory order.
    Each chunk is outlined and numbered at its centre (the number: its place in memory), its
    colour is the ``line_bytes`` cache line holding it (both targets fetch 128-byte lines: CDNA3
    and CDNA4 white papers): a load whose lanes read one colour band fetches whole lines."""
    from matplotlib.patches import Rectangle

    plt = _plt()
    per_line = line_bytes // chunk_bytes
    line_colors = OKABE_ITO[:7] + ("#999999",)
    rows = max(ch.shape[0] for ch in chunks.values())
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH, 9.0))
    # a label must fit the chunk it names: the font follows the height of one token row
    row_points = 72 * 3.6 / rows
    for ax, (name, ch) in zip(axes.flat, chunks.items()):
        ax.imshow((ch // per_line) % 8, cmap=_cmap(line_colors), vmin=-0.5, vmax=7.5, alpha=0.45,
                  aspect="auto", interpolation="nearest")
        for c in range(int(ch.max()) + 1):
            where = np.argwhere(ch == c)
            (t0, d0), (t1, d1) = where.min(axis=0), where.max(axis=0)
            ax.add_patch(Rectangle((d0 - 0.5, t0 - 0.5), d1 - d0 + 1, t1 - t0 + 1, fill=False,
                                   edgecolor="0.25", lw=0.6))
            tall = t1 - t0 > d1 - d0  # a chunk down a column: write along it
            size = min(FONT, 0.8 * row_points) if not tall else FONT - 1
            ax.text((d0 + d1) / 2, (t0 + t1) / 2, str(c), ha="center", va="center", fontsize=size,
                    rotation=90 if tall else 0)
        _style(ax, name, "channel d", "token t in page")
    for ax in axes.flat[len(chunks):]:
        ax.set_visible(False)
    n_lines = min(8, -(-max(int(ch.max()) + 1 for ch in chunks.values()) // per_line))
    fig.legend(handles=_patches([f"line {i}" for i in range(n_lines)], line_colors, alpha=0.45),
               loc="lower center", ncol=min(n_lines, 8), fontsize=FONT,
               title=f"colour: the {line_bytes}-byte cache line holding the {chunk_bytes}-byte chunk "
               "(outlined; number: chunk in memory order)", title_fontsize=FONT)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


# ---------------------------------------------------------------------------------------------
# chapter 01

def mfma_atom(a_lanes: np.ndarray, c_lanes: np.ndarray):
    """The lane holding each element of ``v_mfma_f32_16x16x32_fp8_fp8``'s operands:
    ``a_lanes[m, k]`` for A (B is the same picture with ``n`` for ``m``), ``c_lanes[m, n]`` for the
    result C. Colour = lane group ``lane // 16``; the number is the lane, written once on the run
    of elements it holds (8 consecutive k of one row of A, 4 consecutive rows of one column of C)."""
    plt = _plt()
    colors = OKABE_ITO[:4]
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    for ax, grid, title, xl, yl in ((axes[0], a_lanes, "A[m, k] and B[n, k]: 8 fp8 per lane", "k", "m (or n)"),
                                    (axes[1], c_lanes, "C[m, n]: 4 f32 per lane", "n", "m")):
        ax.imshow(grid // 16, cmap=_cmap(colors), vmin=-0.5, vmax=3.5, alpha=0.55, aspect="auto",
                  interpolation="nearest")
        _label_lanes(ax, grid)
        ax.set_xticks(range(0, grid.shape[1], 4))
        ax.set_yticks(range(0, grid.shape[0], 4))
        _style(ax, title, xl, yl)
    fig.legend(handles=_patches([f"lanes {16 * g}..{16 * g + 15}" for g in range(4)], colors, 0.55),
               loc="lower center", ncol=4, fontsize=FONT)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def wave_split(tile_tokens: int = 256, head_dim: int = 128, waves: int = 4, rows_per_mfma: int = 16):
    """Chapter 1's work split of one tile over a workgroup's waves: wave ``(t % 64) // 16`` owns
    the scores of token ``t`` (Q·Kᵀ), wave ``(d % 64) // 16`` output channel ``d`` (P·V)."""
    plt = _plt()
    span = waves * rows_per_mfma
    colors = OKABE_ITO[:waves]
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH, 3.2))
    for ax, n, title, xl in ((axes[0], tile_tokens, "Q·Kᵀ: wave owning the scores of each token of a tile",
                              "token in the tile"),
                             (axes[1], head_dim, "P·V: wave owning each output channel", "output channel d")):
        owner = (np.arange(n) % span) // rows_per_mfma
        ax.imshow(owner[None, :], aspect="auto", cmap=_cmap(colors), vmin=-0.5, vmax=waves - 0.5,
                  extent=(-0.5, n - 0.5, 0, 1), interpolation="nearest")
        ax.set_xticks(np.arange(0, n + 1, rows_per_mfma * 2 if n > 128 else rows_per_mfma))
        ax.set_yticks([])
        _style(ax, title, xl)
    fig.legend(handles=_patches([f"wave {w}" for w in range(waves)], colors), loc="center right", fontsize=FONT)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    return fig


# ---------------------------------------------------------------------------------------------
# chapter 02

def mfma_ownership(chunk: int = 0, d_chunk: int = 0):
    """Which lane holds which score and which output in chapter 2's fragments of
    ``v_mfma_f32_16x16x32_fp8_fp8``: lane ``l`` holds column ``c = l % 16`` (query head ``c``)
    and rows ``4g .. 4g+3`` with ``g = l // 16``. For the scores of token chunk ``a`` row ``r`` is
    wave-token ``16·(r // 4) + 4a + r % 4``; for the output of d-chunk ``j`` it is channel
    ``16j + r``. The number on a run of 4 rows is the lane holding them, the colour its group ``g``."""
    plt = _plt()
    r = np.arange(16)
    c = np.arange(16)
    lane = c[None, :] + 16 * (r[:, None] // 4)
    colors = OKABE_ITO[:4]
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 4.6))
    panels = ((axes[0], [16 * (i // 4) + 4 * chunk + i % 4 for i in r], f"scores S, token chunk a={chunk}",
               "wave-token (MFMA row)"),
              (axes[1], [16 * d_chunk + i for i in r], f"output O, d-chunk j={d_chunk}", "channel d (MFMA row)"))
    for ax, row_names, title, yl in panels:
        ax.imshow(lane // 16, cmap=_cmap(colors), vmin=-0.5, vmax=3.5, alpha=0.55, interpolation="nearest")
        _label_lanes(ax, lane)
        ax.set_xticks(c)
        ax.set_yticks(r, [str(v) for v in row_names])
        _style(ax, title, "query head c (MFMA column)", yl)
    fig.legend(handles=_patches([f"g={g}: lanes {16 * g}..{16 * g + 15}" for g in range(4)], colors, 0.55),
               loc="lower center", ncol=4, fontsize=FONT)
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    return fig


def wave_dataflow(lane: int = 21):
    """One wave's dataflow in chapter 2's turned-around tile, drawn for every lane at once.

    Lane ``l`` is ``(c, g) = (l % 16, l // 16)``. Colour = the lane group ``g`` holding each
    element; ``lane``'s own elements are outlined in black. The arithmetic is the chapter's:
    K (64 wave-tokens x 128 channels): lane ``(c, g)`` loads token ``16·(c // 4) + 4a + c % 4``
    (a = 0..3), channels ``16g..16g+15`` and ``16g+64..16g+79``, so element ``(t, d)`` belongs
    to lane ``4·(t // 16) + t % 4 + 16·((d % 64) // 16)``; it is the A operand of K·Qᵀ.
    Scores and P (64 tokens x 16 heads): column = head ``c``, tokens ``16g..16g+15``; the same
    registers are the B operand of V·P. V (128 channels x 64 tokens), the A operand of V·P:
    lane ``(c, g)`` holds channels ``16j + c``, tokens ``16g..16g+15``. O (128 channels x 16
    heads): column ``c``, channels ``16j + 4g .. +3``."""
    from matplotlib.patches import Rectangle

    plt = _plt()
    c0, g0 = lane % 16, lane // 16
    t = np.arange(64)
    d = np.arange(128)
    h = np.arange(16)
    k_lane = (4 * (t[:, None] // 16) + t[:, None] % 4) + 16 * ((d[None, :] % 64) // 16)
    s_lane = h[None, :] + 16 * (t[:, None] // 16)
    v_lane = (d[:, None] % 16) + 16 * (t[None, :] // 16)
    o_lane = h[None, :] + 16 * ((d[:, None] % 16) // 4)
    colors = OKABE_ITO[:4]
    fig = plt.figure(figsize=(WIDTH, 7.4))
    gs = fig.add_gridspec(2, 3, width_ratios=[2.0, 1.0, 1.0], hspace=0.45, wspace=0.35)
    panels = (
        (fig.add_subplot(gs[0, 0]), k_lane, "1. K bytes each lane loads (A of K·Qᵀ)", "channel", "wave-token"),
        (fig.add_subplot(gs[0, 1]), s_lane, "2. scores K·Qᵀ: a column per head", "query head", "wave-token"),
        (fig.add_subplot(gs[0, 2]), s_lane, "3. P = B of V·P (same registers)", "query head", "wave-token"),
        (fig.add_subplot(gs[1, 0]), v_lane.T, "4. V bytes each lane loads (A of V·P)", "channel",
         "wave-token"),
        (fig.add_subplot(gs[1, 1]), o_lane, "5. output V·P: a column per head", "query head", "channel"),
    )
    for ax, grid, title, xl, yl in panels:
        ax.imshow(grid // 16, cmap=_cmap(colors), vmin=-0.5, vmax=3.5, alpha=0.55, aspect="auto",
                  interpolation="nearest")
        for i, j in np.argwhere(grid == lane):  # the chosen lane's elements, outlined one by one
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="black", alpha=0.55, lw=0))
        _style(ax, title, xl, yl)
    note = fig.add_subplot(gs[1, 2])
    note.axis("off")
    note.set_title("what lane %d (c=%d, g=%d) holds" % (lane, c0, g0), fontsize=FONT + 1)
    toks = [16 * (c0 // 4) + 4 * a + c0 % 4 for a in range(4)]
    lines = [f"K: tokens {toks[0]}, {toks[1]}, {toks[2]}, {toks[3]}",
             f"   channels {16 * g0}-{16 * g0 + 15}, {16 * g0 + 64}-{16 * g0 + 79}",
             f"scores and P: head {c0},", f"   tokens {16 * g0}-{16 * g0 + 15}",
             f"V: channels {c0}, {16 + c0}, ... {112 + c0},", f"   tokens {16 * g0}-{16 * g0 + 15}",
             f"O: head {c0},", f"   channels 16j+{4 * g0} .. +{4 * g0 + 3}",
             "", "P never leaves the lane:", "its scores are the", "B operand of V·P"]
    note.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", fontsize=FONT, family="monospace",
              transform=note.transAxes)
    handles = _patches([f"g={g}: lanes {16 * g}..{16 * g + 15}" for g in range(4)], colors, 0.55)
    handles += _patches([f"lane {lane}"], ["black"], 0.55)
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=FONT)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.95, bottom=0.11)
    return fig


def softmax_butterfly(head: int = 0):
    """The row max of one query head across the 4 lanes that hold its scores (lanes
    ``head + 16g``, 16 consecutive wave-tokens each): an in-lane max over 16 scores, then two
    exchanges, lane ``l`` with ``l ^ 16`` and with ``l ^ 32``; after them all four agree."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6))
    steps = ("in-lane max of its 16 scores\n(15 v_max)", "after exchange with l ^ 16", "after exchange with l ^ 32")
    span = (lambda g: (16 * g, 16 * g + 15), lambda g: (32 * (g // 2), 32 * (g // 2) + 31), lambda g: (0, 63))
    for x, rng in enumerate(span):
        for g in range(4):
            lo, hi = rng(g)
            ax.text(x, g, f"lane {head + 16 * g}: max of tokens {lo}-{hi}", ha="center", va="center", fontsize=FONT,
                    bbox=dict(boxstyle="round", facecolor=OKABE_ITO[1], alpha=0.5 + 0.15 * x, edgecolor="0.3"))
    for x, bit, color in ((1, 1, OKABE_ITO[5]), (2, 2, OKABE_ITO[2])):
        for g in range(4):
            ax.annotate("", xy=(x - 0.3, g ^ bit), xytext=(x - 0.7, g),
                        arrowprops=dict(arrowstyle="->", color=color, lw=1.4))
    ax.plot([], [], color=OKABE_ITO[5], label="step 1: lanes l and l ^ 16 swap values, keep the max")
    ax.plot([], [], color=OKABE_ITO[2], label="step 2: lanes l and l ^ 32 swap values, keep the max")
    ax.set_xticks(range(3), steps)
    ax.set_yticks(range(4), [f"g={g}" for g in range(4)])
    ax.set_xlim(-0.5, 2.5)
    ax.set_ylim(3.5, -0.5)
    ax.legend(fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    _style(ax, f"Row max of query head {head}: 4 lanes, 2 butterfly steps", None, "lane group g = lane // 16")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# chapters 03 and 04

#: bytes of a vL1D / L2 line on both targets (pa_tile.emu.memory.LINE_BYTES, restated here because
#: this module imports no emulator; tests/test_figures.py checks they agree)
LINE_BYTES = 128


def lane_lines(offsets: Mapping[str, np.ndarray], nbytes: int = 16, group_lanes: int = 4,
               ksteps: bool = False, notes: Optional[Mapping[str, str]] = None):
    """Where each lane's bytes of one wave-wide load lie, line by line. ``offsets[name]``: each lane's
    first byte, relative to the tensor's start (line-aligned on a GPU), as the emulator traced it;
    each lane reads ``nbytes``. A row per 128-byte line touched (in address order), a box per lane
    at its place in the line, coloured by the lane's MFMA group ``g = lane // 16`` and labelled with
    the lane. The title counts the lines (what the wave fetches) and the (group of ``group_lanes``
    consecutive lanes, line) pairs: the vL1D addresser takes 64 bytes of request a clock, 4 lanes
    of a dwordx4, and pa_tile's timing model ASSUMES each such group pays a clock per line it
    touches. ``ksteps``: hatch the second half of each lane's bytes (its second MFMA k-step).
    ``notes[name]``: a line of text written in that panel's empty right-hand part."""
    plt = _plt()
    from matplotlib.patches import Rectangle

    n = len(offsets)
    fig, axes = plt.subplots(1, n, figsize=(WIDTH, 4.6), squeeze=False)
    for ax, (name, off) in zip(axes.flat, offsets.items()):
        off = np.asarray(off, dtype=np.int64)
        lanes = np.arange(off.size)
        first, last = off // LINE_BYTES, (off + nbytes - 1) // LINE_BYTES
        lines = np.unique(np.concatenate([first, last]))
        row = {int(ln): i for i, ln in enumerate(lines)}
        pairs = {(int(lane) // group_lanes, int(ln)) for lane, a, b in zip(lanes, first, last) for ln in (a, b)}
        for lane, o in zip(lanes, off):
            y, x = row[int(o // LINE_BYTES)], int(o % LINE_BYTES)
            color = OKABE_ITO[(int(lane) // 16) % 4]
            ax.add_patch(Rectangle((x, y - 0.42), nbytes, 0.84, facecolor=color, edgecolor="0.25", lw=0.6,
                                   alpha=0.75))
            if ksteps:
                ax.add_patch(Rectangle((x + nbytes / 2, y - 0.42), nbytes / 2, 0.84, fill=False, hatch="///",
                                       edgecolor="0.35", lw=0))
            ax.text(x + nbytes / (4 if ksteps else 2), y, str(int(lane)), ha="center", va="center",
                    fontsize=FONT)
        ax.set_xlim(0, LINE_BYTES)
        ax.set_ylim(lines.size - 0.5, -0.5)
        ax.set_xticks(range(0, LINE_BYTES + 1, 16))
        ax.set_yticks(range(lines.size))
        ax.set_yticklabels([str(i + 1) for i in range(lines.size)])
        ax.grid(axis="x", color="0.85", lw=0.5)
        if notes and name in notes:
            ax.text(0.98, 0.5, notes[name], transform=ax.transAxes, ha="right", va="center",
                    fontsize=FONT, color="0.3", wrap=True)
        _style(ax, f"{name}: {lines.size} lines, {len(pairs)} (4-lane group, line) pairs",
               "byte within the 128-byte line", "line touched (address order)")
    handles = _patches([f"g={g}: lanes {16 * g}..{16 * g + 15}" for g in range(4)], OKABE_ITO[:4], 0.75)
    if ksteps:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="white", edgecolor="0.35", hatch="///", label="second k-step's 8 bytes"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=FONT)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def lds_banks(strides: Sequence[int] = (4, 5), banks: int = 32, heads: int = 16, wave: int = 0):
    """Banks of the merge's ``(max, sum)`` table writes: lane ``(c, g)`` of wave ``wave`` writes
    word ``stride·c + wave``; the 32 lanes served together (heads 0..15, each twice: a broadcast)
    hit bank ``word mod banks``. Two different words in one bank cost one extra cycle."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(strides), figsize=(WIDTH, 3.6), sharey=True, squeeze=False)
    degree_colors = {1: OKABE_ITO[2], 2: OKABE_ITO[5], 3: OKABE_ITO[6], 4: OKABE_ITO[7]}
    for ax, stride in zip(axes[0], strides):
        c = np.arange(heads)
        bank = (stride * c + wave) % banks
        words_per_bank = {b: np.unique((stride * c + wave)[bank == b]).size for b in np.unique(bank)}
        deg = np.array([words_per_bank[b] for b in bank])
        for d in sorted(set(deg)):
            sel = deg == d
            ax.scatter(bank[sel], c[sel], s=40, color=degree_colors.get(d, "0.5"), zorder=3,
                       label="1 word in the bank: no conflict" if d == 1 else f"{d} words in the bank: {d}-way conflict")
        ax.set_xlim(-0.5, banks - 0.5)
        ax.set_xticks(range(0, banks, 4))
        ax.set_yticks(range(heads))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=FONT, loc="lower right")
        _style(ax, f"head row of {stride} words: {len(words_per_bank)} banks, worst {max(deg)}-way",
               "LDS bank (4-byte words mod 32)", "query head c (lanes c, c+16)")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# chapter 05

def phase_timeline(m_tiles: int = 2, tiles: int = 2):
    """One wave's instruction stream for ``tiles`` trips of chapter 5's loop, between the query's
    staging and the merge, M-tile by M-tile (top) against the phase split (bottom). Phase A, on
    K's registers: each M-tile's scores, row max, exp and fp8 pack; V is issued after the last
    M-tile's scores, into the registers K just freed. Phase B, on V's registers: every M-tile's
    P·V. Without the split K and V are in registers together. Dashed lines are
    ``sched_barrier`` (a compiler fence: no wait); solid lines are workgroup ``s_barrier`` s:
    one after the query is staged, the rest in the merge."""
    plt = _plt()
    kinds = {"query": ("query: loaded once, staged in LDS", OKABE_ITO[2], 1.2),
             "load": ("K loads, page ids", OKABE_ITO[7], 1.0), "score": ("scores (Q from LDS)", OKABE_ITO[4], 1.0),
             "soft": ("row max, exp, fp8 pack", OKABE_ITO[1], 1.0),
             "vload": ("V loads (into K's registers)", "#999999", 1.0),
             "pv": ("P·V", OKABE_ITO[0], 0.8), "merge": ("merge of the 4 waves", OKABE_ITO[6], 0.9)}
    fig, ax = plt.subplots(figsize=(WIDTH, 3.6))

    def draw(y, seq):
        x = 0.0
        for kind, label, fence in seq:
            name, color, width = kinds[kind]
            ax.barh(y, width, left=x, height=0.6, color=color, edgecolor="white")
            if label:
                ax.text(x + width / 2, y, label, ha="center", va="center", fontsize=FONT,
                        color="white" if kind in ("load", "score") else "black")
            x += width
            if fence == "sched":
                ax.plot([x, x], [y - 0.38, y + 0.38], "--", color="0.2", lw=1)
            elif fence == "barrier":
                ax.plot([x, x], [y - 0.45, y + 0.45], "-", color=OKABE_ITO[5], lw=2)
        return x

    merge = [("merge", "", "barrier")] + [("merge", f"m{m}", "barrier") for m in range(m_tiles)]
    naive, split = [("query", "", "barrier")], [("query", "", "barrier")]
    for _ in range(tiles):
        naive += [("load", "", None), ("vload", "", None)] + sum(
            ([("score", f"m{m}", None), ("soft", f"m{m}", None), ("pv", f"m{m}", None)] for m in range(m_tiles)), [])
        split += [("load", "", "sched")]
        for m in range(m_tiles):
            split += [("score", f"m{m}", "sched" if m == m_tiles - 1 else None)]
            if m == m_tiles - 1:
                split += [("vload", "", None)]
            split += [("soft", f"m{m}", "sched" if m < m_tiles - 1 else None)]
        split += [("pv", f"m{m}", "sched" if m < m_tiles - 1 else None) for m in range(m_tiles)]
    end = max(draw(1, naive + merge), draw(0, split + merge))
    ax.set_yticks([0, 1], ["phase split\n(chapter 5)", "M-tile by M-tile"])
    ax.set_xticks([])
    ax.set_xlim(0, end + 0.2)
    ax.set_ylim(-0.6, 1.6)
    handles = _patches([v[0] for v in kinds.values()], [v[1] for v in kinds.values()])
    handles += [plt.Line2D([], [], ls="--", color="0.2", label="sched_barrier (compiler fence)"),
                plt.Line2D([], [], ls="-", color=OKABE_ITO[5], lw=2, label="s_barrier (whole workgroup)")]
    ax.legend(handles=handles, fontsize=FONT, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    _style(ax, f"One wave, {tiles} tiles of the loop between the query's staging and the merge, "
           f"{m_tiles} M-tiles per workgroup", None, None)
    ax.set_xlabel("issue order (schematic, not to scale) →", fontsize=FONT)
    fig.tight_layout()
    return fig


def traffic_bars(labels: Sequence[str], series: Mapping[str, Sequence[float]], *, title: str,
                 ylabel: str = "bytes loaded / compulsory bytes"):
    """Grouped bars of a call's loaded bytes against the compulsory bytes, one group per shape
    ``labels[i]`` and one bar per ``series`` (name -> ratios), with the 1.0 line (every byte once)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2))
    n = len(series)
    width = 0.8 / n
    x = np.arange(len(labels))
    for k, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + (k - (n - 1) / 2) * width, values, width, label=name, color=LINE_COLORS[k % len(LINE_COLORS)])
        for b, v in zip(bars, values):
            ax.text(b.get_x() + b.get_width() / 2, v + 0.03, f"{v:.2f}", ha="center", va="bottom", fontsize=FONT - 1)
    ax.axhline(1.0, color="0.3", lw=1, ls="--")
    ax.set_xticks(x, labels)
    ax.legend(fontsize=FONT, loc="upper left")
    _style(ax, title, None, ylabel)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# chapters 05 and 06

def upstream_margins(rows: Sequence[Mapping], metrics: Sequence[tuple], *,
                     groups: Sequence[str] = ("head_dim", "query_len"), color: str = "scales",
                     marker: Optional[str] = None, title: str = "This kernel against upstream's recorded figures"):
    """This kernel against upstream's recorded figures, configuration by configuration.

    One panel per ``metrics`` entry ``(label, ours_key, upstream_key, higher_is_better)``: each
    row's margin in this kernel's favour (``ours − upstream`` when higher is better, e.g. waves per
    SIMD; ``upstream − ours`` when lower is, e.g. registers), so 0 is a tie and every point at or
    above the dashed line meets or beats upstream (a point below is drawn hollow; the panel's
    title counts them). Configurations sit in blocks of equal ``groups`` keys, labelled on the x
    axis; colour = the ``color`` key, marker = the ``marker`` key (optional)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    rows = list(rows)

    def block(r):
        return tuple(r[g] for g in groups)

    order = sorted(range(len(rows)), key=lambda i: block(rows[i]))  # stable: a block keeps the given order
    xs, centers, labels, bounds, pos = {}, [], [], [], 0
    for b in dict.fromkeys(block(rows[i]) for i in order):
        members = [i for i in order if block(rows[i]) == b]
        for k, i in enumerate(members):
            xs[i] = pos + k
        centers.append(pos + (len(members) - 1) / 2)
        labels.append("\n".join(f"{g} {v}" for g, v in zip(groups, b)))
        pos += len(members) + 1
        bounds.append(pos - 1)
    cvals = list(dict.fromkeys(sorted((r[color] for r in rows), key=str)))
    cmap = {v: LINE_COLORS[k % len(LINE_COLORS)] for k, v in enumerate(cvals)}
    mvals = list(dict.fromkeys(sorted((r[marker] for r in rows), key=str))) if marker else [None]
    mmap = {v: "osD^v"[k % 5] for k, v in enumerate(mvals)}
    fig, axes = plt.subplots(len(metrics), 1, figsize=(WIDTH, 1.2 + 1.9 * len(metrics)), sharex=True, squeeze=False)
    for ax, (label, ours, up, higher) in zip(axes[:, 0], metrics):
        margin = [(r[ours] - r[up]) if higher else (r[up] - r[ours]) for r in rows]
        for i, r in enumerate(rows):
            c = cmap[r[color]]
            ax.scatter(xs[i], margin[i], s=22, marker=mmap[r[marker] if marker else None], color=c,
                       facecolors=c if margin[i] >= 0 else "none", edgecolors="0.2", linewidths=0.4, zorder=3)
        ax.axhline(0, color="0.3", lw=1, ls="--", zorder=1)
        for b in bounds[:-1]:
            ax.axvline(b, color="0.85", lw=0.8, zorder=0)
        ax.grid(axis="y", alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        meets = sum(m >= 0 for m in margin)
        _style(ax, f"{label}: {meets} of {len(rows)} configurations meet or beat upstream "
                   f"(margin {min(margin):g} to {max(margin):g})", None,
               f"{'ours − upstream' if higher else 'upstream − ours'}")
    axes[-1, 0].set_xticks(centers, labels)
    axes[-1, 0].set_xlim(-1, pos - 1)
    handles = [Line2D([], [], ls="", marker="o", color=cmap[v], mec="0.2", mew=0.4, label=f"{color} {v}")
               for v in cvals]
    if marker:
        handles += [Line2D([], [], ls="", marker=mmap[v], color="0.6", mec="0.2", mew=0.4, label=f"{marker} {v}")
                    for v in mvals]
    handles.append(Line2D([], [], ls="--", color="0.3", label="upstream (margin 0)"))
    top = 1 - 0.42 / fig.get_size_inches()[1]  # room for the title and the legend
    fig.suptitle(title, fontsize=FONT + 2, y=1 - 0.08 / fig.get_size_inches()[1], va="top")
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=FONT,
               bbox_to_anchor=(0.5, 1 - 0.25 / fig.get_size_inches()[1]))
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


# ---------------------------------------------------------------------------------------------
# chapter 07

def split_k(context_lengths: Sequence[int], num_partitions: int, tile_tokens: int = 256):
    """Split-K as chapter 7 runs it: sequence ``s`` has ``n = ceil(L_s / 256)`` tiles; partition
    ``z`` (grid z) takes tiles ``[z·tpp, min((z+1)·tpp, n))`` with ``tpp = ceil(n / P)``, so a
    short sequence leaves partitions empty (they write ``ℓ = 0`` and drop out of the reduce).
    The reduce combines each row's ``(m_z, ℓ_z, o_z)``."""
    plt = _plt()
    colors = OKABE_ITO[:7]
    fig, ax = plt.subplots(figsize=(WIDTH, 0.7 * len(context_lengths) + 2.0))
    used = set()
    for s, L in enumerate(context_lengths):
        n = -(-L // tile_tokens)
        tpp = -(-n // num_partitions)
        for t in range(n):
            z = t // tpp
            used.add(z)
            full = min(tile_tokens, L - t * tile_tokens)
            ax.barh(s, full, left=t * tile_tokens, height=0.6, color=colors[z % len(colors)], edgecolor="white")
            if full < tile_tokens:  # the masked tail of the last tile
                ax.barh(s, tile_tokens - full, left=t * tile_tokens + full, height=0.6, color="none",
                        edgecolor="0.5", hatch="///", lw=0.5)
        empty = [z for z in range(num_partitions) if z * tpp >= n]
        ax.text(n * tile_tokens + 40, s, f"tpp={tpp}" + (f", partitions {empty} empty" if empty else ""),
                va="center", fontsize=FONT)
    handles = _patches([f"partition z={z}" for z in sorted(used)], [colors[z % len(colors)] for z in sorted(used)])
    from matplotlib.patches import Patch

    handles.append(Patch(facecolor="none", edgecolor="0.5", hatch="///", label="past the context (masked)"))
    ax.legend(handles=handles, fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=min(len(handles), 5))
    ax.set_yticks(range(len(context_lengths)), [f"seq {s} (L={L})" for s, L in enumerate(context_lengths)])
    ax.invert_yaxis()
    longest = max(-(-L // tile_tokens) for L in context_lengths) * tile_tokens
    ax.set_xticks(range(0, longest + 1, tile_tokens))
    ax.set_xlim(0, longest * 1.45)
    ax.grid(axis="x", alpha=0.3)
    ax.text(0.985, 0.5, "the reduce, per\nquery row, over z:\n\nM = max m_z\nw_z = ℓ_z·exp(m_z − M)\n"
            "o = Σ w_z·o_z / Σ w_z\n\n(empty: ℓ_z = 0, w_z = 0)", transform=ax.transAxes, ha="right", va="center",
            fontsize=FONT, multialignment="left", bbox=dict(boxstyle="round", facecolor="white", edgecolor="0.4"))
    _style(ax, f"Split-K with num_partitions = {num_partitions}: which partition reads each tile",
           "token (tile boundaries every 256)", None)
    fig.tight_layout()
    return fig


def kernel_map(*, head_dim: int, group: int, waves: int, wave_lanes: int, tile_tokens: int,
               lds_regions: Mapping[str, int], lds_bytes: int, reduce_group: int, reduce_threads: int,
               entries: int = 6, kv_rows: int = 3):
    """The finished kernel on one screen: grid -> workgroup -> wave -> lane for the partial
    kernel, its LDS, the partials it writes and the reduce that merges them.

    Everything drawn is passed in from the compiled specialization the chapter describes:
    ``lds_regions`` maps each LDS field of the kernel's struct to its bytes (drawn to scale) and
    ``lds_bytes`` is what the compiled kernel reserves; ``waves`` x ``wave_lanes`` threads a
    workgroup, each wave scoring ``tile_tokens / waves`` tokens of a tile and multiplying P by V
    for ``head_dim / waves`` channels; a lane is ``16·grp + col`` (``col``: query row of the
    16-row M-tile, ``grp``: a 16-token slice of the wave's tokens). ``entries`` x ``kv_rows``
    cells of the grid are drawn (a sample: the real grid is the work list's length by KV heads)."""
    plt = _plt()
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, ax = plt.subplots(figsize=(WIDTH, 5.6))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 62)
    ax.axis("off")
    wc = OKABE_ITO[:waves] if waves <= 7 else [OKABE_ITO[w % 7] for w in range(waves)]

    def box(x, y, w, h, color="white", text=None, fs=FONT, ec="0.3", lw=0.8, **kw):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=ec, lw=lw, **kw))
        if text:
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs)

    def arrow(x0, y0, x1, y1, text=None):
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=10, color="0.25", lw=1))
        if text:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 1.2, text, ha="center", va="bottom", fontsize=FONT - 1)

    def title(x, y, text):
        ax.text(x, y, text, ha="left", va="bottom", fontsize=FONT + 1, fontweight="bold")

    # 1. the grid of the partial kernel
    title(0, 57, "1 · grid (partial kernel)")
    cw, ch = 4.0, 4.0
    for i in range(entries):
        for j in range(kv_rows):
            hot = (i, j) == (2, 1)
            box(1 + i * cw, 36 + j * ch, cw, ch, color=OKABE_ITO[4] if hot else "0.93", lw=0.6)
    ax.text(1 + entries * cw / 2, 34.5, "x: work-list entry\n(sequence, tiles t0..t1)", ha="center", va="top",
            fontsize=FONT - 1)
    ax.text(2 + entries * cw, 36 + kv_rows * ch / 2, "y: KV head\n× M-group", ha="left", va="center",
            fontsize=FONT - 1)
    ax.text(1, 55, f"one workgroup per cell: its tiles, all its query rows\n(z: partition, when the split is "
            f"uniform)\ndrawn: head_dim {head_dim}, group {group}", ha="left", va="top", fontsize=FONT - 1)
    arrow(1 + 3 * cw, 36 + 1.5 * ch, 37, 47)

    # 2. one workgroup: a tile's tokens split by wave for the scores, head_dim split by wave for P·V
    title(37, 57, f"2 · workgroup: {waves} waves, loop over its {tile_tokens}-token tiles")
    span = tile_tokens // waves
    for w in range(waves):
        box(37 + w * 9, 48, 9, 4, color=wc[w], text=f"w{w}: {w * span}-{(w + 1) * span - 1}", fs=FONT - 1)
    ax.text(37, 52.6, "scores S = K·Qᵀ and row max: wave w takes tokens", ha="left", va="bottom", fontsize=FONT - 1)
    ax.text(74, 50, "→ P (fp8)\n   to LDS", ha="left", va="center", fontsize=FONT - 1)
    dq = head_dim // waves
    for w in range(waves):
        box(37 + w * 9, 39, 9, 4, color=wc[w], text=f"w{w}: d {w * dq}-{(w + 1) * dq - 1}", fs=FONT - 1)
    ax.text(37, 43.6, f"O += P·V: wave w owns {dq} of {head_dim} channels, all tokens", ha="left", va="bottom",
            fontsize=FONT - 1)
    ax.text(74, 41, "← P of every\n   wave, LDS", ha="left", va="center", fontsize=FONT - 1)
    ax.text(37, 36.5, "after the last tile: each row's max and sum merged across waves in LDS", ha="left",
            va="top", fontsize=FONT - 1)
    arrow(40, 39, 24, 29.5)

    # 3. one wave: 64 lanes, lane = 16·grp + col
    title(0, 27.5, f"3 · wave: {wave_lanes} lanes")
    groups = wave_lanes // 16
    for g in range(groups):
        for c in range(16):
            box(1 + c * 1.7, 20 - g * 2.2, 1.7, 2.2, color=LINE_COLORS[g % len(LINE_COLORS)], lw=0.3)
        ax.text(29, 21.1 - g * 2.2, f"grp {g}", va="center", fontsize=FONT - 1)
    ax.text(1, 23.2, "col 0 … 15 = query row of the M-tile", fontsize=FONT - 1, va="bottom")
    ax.text(1, 20 - groups * 2.2 + 1.3, "lane = 16·grp + col; grp: its 16 of\nthe wave's tokens",
            fontsize=FONT - 1, va="top")

    # 4. the workgroup's LDS, to scale
    title(37, 27.5, f"4 · LDS of one workgroup ({lds_bytes:,} B compiled)")
    total = sum(lds_regions.values())
    x = 37.0
    for k, (name, nbytes) in enumerate(lds_regions.items()):
        w = 36.0 * nbytes / total
        box(x, 19, w, 5, color=OKABE_ITO[(k + 1) % 7], lw=0.6)
        ax.text(x + w / 2, 18.3 - 2.6 * (k % 2), f"{name}\n{nbytes:,} B", ha="center", va="top",
                fontsize=FONT - 1)
        x += w

    # 5. partials -> reduce -> out
    title(37, 8.5, "5 · split: partials, then the reduce")
    box(37, 2, 16, 5, color="0.93", text="workspace: per entry\nm, ℓ, o (float32)", fs=FONT - 1)
    arrow(53.5, 4.5, 60, 4.5)
    box(60, 2, 22, 5, color=OKABE_ITO[2], fs=FONT - 1,
        text=f"reduce: {reduce_threads} threads, 4 channels\na lane, {reduce_group} partitions a load")
    arrow(82.5, 4.5, 88, 4.5)
    box(88, 2, 9, 5, color="white", text="out", fs=FONT)
    ax.legend(handles=_patches([f"wave {w}" for w in range(waves)], wc), loc="upper right", ncol=waves,
              fontsize=FONT - 1, bbox_to_anchor=(1.0, 1.04), frameon=False)
    fig.suptitle("The finished kernel on one screen", fontsize=FONT + 2, x=0.01, ha="left")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# chapter 09

def roofline(shapes, gpus: Sequence[str] = ("MI300X", "MI355X"), *, whole_pages: bool = False):
    """Log-log time floor (bytes / HBM bandwidth) against context length: one colour per
    (batch, head_dim), one line style and marker per GPU; the legend sits beside the axes."""
    from pa_tile.perf import roofline as rl

    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 4.0))
    series: Dict[tuple, list] = {}
    for s in shapes:
        series.setdefault((s.batch, s.head_dim, s.query_length), []).append(s)
    styles = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))
    for ki, (key, ss) in enumerate(sorted(series.items())):
        b, d, ql = key
        ss = sorted(ss, key=lambda s: s.max_context)
        for gi, g in enumerate(gpus):
            spec = rl.gpu_spec(g)
            ls, mk = styles[gi % len(styles)]
            ax.loglog([s.max_context for s in ss], [rl.time_floor(s, spec, whole_pages=whole_pages).time_us for s in ss],
                      ls=ls, marker=mk, ms=3.5, color=LINE_COLORS[ki % len(LINE_COLORS)],
                      label=f"{spec.name} batch {b}, d{d}" + ("" if ql == 1 else f", ql{ql}"))
    heads = sorted({(s.num_q_heads, s.num_kv_heads) for s in shapes})
    _style(ax, "Decode time floor = bytes moved / HBM bandwidth (heads q/kv: "
           + ", ".join(f"{q}/{k}" for q, k in heads) + ")", "context length (tokens)", "time floor (µs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="colour: batch, head_dim;\n"
              "line: GPU", title_fontsize=FONT)
    fig.tight_layout()
    return fig


_FAMILIES = ("buffer", "global", "ds", "mfma", "valu", "salu", "waitcnt", "barrier", "branch", "smem", "other")


def _family_colors():
    import matplotlib

    cm = matplotlib.colormaps["cividis"]
    return {f: cm(i / (len(_FAMILIES) - 1)) for i, f in enumerate(_FAMILIES)}


def _pick(rows, **kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def static_facts(static: Sequence[dict], names: Sequence[str], configs: Sequence[tuple],
                 ref: tuple = ("gfx942", 16)):
    """Chapter 8's static facts of the compiled stages (``stage_metrics.collect``'s ``static``
    rows): registers, occupancy, LDS and main-loop length per (arch, block size), with one
    shared legend; the loop's instruction families and the kernel's load widths for ``ref``.
    AGPRs are drawn hatched on top of the VGPRs wherever a stage uses any."""
    plt = _plt()
    x = np.arange(len(names))
    width = 0.8 / len(configs)
    fig, axs = plt.subplots(2, 3, figsize=(WIDTH, 6.6))
    any_agpr = False
    for ci, (arch, bs) in enumerate(configs):
        sel = [_pick(static, stage=n, arch=arch, block_size=bs)[0] for n in names]
        off = x - 0.4 + width * (ci + 0.5)
        color = OKABE_ITO[ci % len(OKABE_ITO)]
        agpr = [s["agpr"] for s in sel]
        any_agpr |= any(agpr)
        axs[0, 0].bar(off, [s["vgpr_unified"] - a for s, a in zip(sel, agpr)], width, color=color,
                      label=f"{arch} block {bs}")
        axs[0, 0].bar(off, agpr, width, bottom=[s["vgpr_unified"] - a for s, a in zip(sel, agpr)], color=color,
                      hatch="///", edgecolor="0.2", lw=0)
        axs[0, 1].bar(off, [s["waves_per_simd"] for s in sel], width, color=color)
        axs[0, 2].bar(off, [s["lds_bytes"] / 1024 for s in sel], width, color=color)
        axs[1, 1].bar(off, [s["loop_instructions"] for s in sel], width, color=color)
    _style(axs[0, 0], "VGPR + AGPR per lane" + (" (AGPR hatched)" if any_agpr else " (no AGPRs used)"),
           None, "registers")
    _style(axs[0, 1], "waves per SIMD", None, "waves")
    _style(axs[0, 2], "LDS per workgroup", None, "KiB")
    _style(axs[1, 1], "main-loop instructions", None, "instructions (static)")
    refs = [_pick(static, stage=n, arch=ref[0], block_size=ref[1])[0] for n in names]
    colors = _family_colors()
    bottom = np.zeros(len(names))
    for f in _FAMILIES:
        vals = np.array([s["loop_families"].get(f, 0) for s in refs], float)
        if vals.any():
            axs[1, 0].bar(x, vals, 0.6, bottom=bottom, label=f, color=colors[f], edgecolor="white", lw=0.4)
            bottom += vals
    _style(axs[1, 0], f"main loop by family ({ref[0]}, block {ref[1]})", None, "instructions")
    widths = sorted({(sp, w) for s in refs for sp, d in s["load_widths"].items() for w in d},
                    key=lambda k: (k[0] == "ds", k))
    bottom = np.zeros(len(names))
    import matplotlib

    viridis = matplotlib.colormaps["viridis"]  # not the configs' colours: these are load widths
    for wi, (sp, w) in enumerate(widths):
        vals = np.array([s["load_widths"].get(sp, {}).get(w, 0) for s in refs], float)
        axs[1, 2].bar(x, vals, 0.6, bottom=bottom, label=f"{sp} {w}", color=viridis(wi / max(1, len(widths) - 1)),
                      edgecolor="white", lw=0.4)
        bottom += vals
    _style(axs[1, 2], f"loads by width ({ref[0]}, block {ref[1]})", None, "load instructions")
    for a in axs.flat:
        a.set_xticks(x, names)
        a.set_xlabel("stage", fontsize=FONT)
        a.grid(axis="y", alpha=0.3)
    axs[1, 0].legend(fontsize=FONT - 1, ncol=2)
    axs[1, 2].legend(fontsize=FONT - 1)
    fig.legend(*axs[0, 0].get_legend_handles_labels(), loc="upper center", ncol=len(configs), fontsize=FONT,
               bbox_to_anchor=(0.5, 0.955))
    fig.suptitle("Static facts of the compiled stages (group 8, head_dim 128)", fontsize=FONT + 2)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def trace_facts(trace: Sequence[dict], names: Sequence[str], archs: Sequence[str], ref: str = "gfx942"):
    """Chapter 8's emulator-trace facts (``stage_metrics.collect``'s ``trace`` rows): bytes per
    K/V load, coalescing, LDS bank conflicts per arch, and the executed instruction mix of one
    256-token tile on ``ref``. Colour = arch, hatching = V (plain = K)."""
    plt = _plt()
    tx = np.arange(len(names))
    fig, axs = plt.subplots(2, 2, figsize=(WIDTH, 6.4))
    bw = 0.8 / (2 * len(archs))
    for ai, arch in enumerate(archs):
        sel = [_pick(trace, stage=n, arch=arch)[0] for n in names]
        color = OKABE_ITO[4 if ai == 0 else 0]
        for ti, (tensor, hatch) in enumerate((("k", ""), ("v", "//"))):
            o = tx - 0.4 + bw * (2 * ai + ti + 0.5)
            lab = f"{tensor.upper()} {arch}"
            axs[0, 0].bar(o, [t[tensor]["bytes_per_load"] for t in sel], bw, hatch=hatch, label=lab, color=color,
                          edgecolor="k", lw=0.4)
            axs[0, 1].bar(o, [t[tensor]["coalescing"] for t in sel], bw, hatch=hatch, label=lab, color=color,
                          edgecolor="k", lw=0.4)
        o = tx - 0.2 + 0.4 * ai
        axs[1, 0].bar(o, [t["lds_max_degree"] for t in sel], 0.38, color=color, label=f"worst degree, {arch}")
        axs[1, 0].plot(o, [t["lds_conflict_cycles_per_tile"] / 100 for t in sel], "kv" if ai else "k^",
                       label=f"conflict cycles per tile ÷ 100, {arch}")
    _style(axs[0, 0], "bytes per K/V load instruction (one wave)", "stage", "bytes")
    _style(axs[0, 1], "coalescing: bytes used / 128-byte lines' bytes", "stage", "fraction")
    _style(axs[1, 0], "LDS bank conflicts (1 = conflict free)", "stage", "degree / cycles ÷ 100")
    colors = _family_colors()
    bottom = np.zeros(len(names))
    for f in _FAMILIES:
        vals = np.array([t["families_per_tile"].get(f, 0) for t in _pick_all(trace, names, ref)], float)
        if vals.any():
            axs[1, 1].bar(tx, vals, 0.6, bottom=bottom, label=f, color=colors[f], edgecolor="white", lw=0.4)
            bottom += vals
    _style(axs[1, 1], f"wave-instructions per 256-token tile ({ref})", "stage", "executed")
    for a in axs.flat:
        a.set_xticks(tx, names)
        a.grid(axis="y", alpha=0.3)
    fig.legend(*axs[0, 0].get_legend_handles_labels(), loc="upper center", ncol=2 * len(archs), fontsize=FONT,
               bbox_to_anchor=(0.5, 0.955))
    axs[0, 1].set_ylim(0, 1.1)
    axs[1, 0].legend(fontsize=FONT - 1)
    axs[1, 1].legend(fontsize=FONT - 1, ncol=2)
    fig.suptitle("Memory behaviour and executed work, from the emulator trace", fontsize=FONT + 2)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def _pick_all(rows, names, arch):
    return [_pick(rows, stage=n, arch=arch)[0] for n in names]


def partition_sweep(panels: Mapping[str, Mapping[str, tuple]], picks: Mapping[str, Mapping[str, Mapping[str, int]]],
                    *, note: str = ""):
    """Predicted time against the split-K partition count, one panel per problem shape.

    ``panels[label][gpu] = (partitions, predicted_us)``; ``picks[label][gpu]`` maps policies
    (``"rule"``, ``"fastest"``: the model's table, ``"default"``: the table capped at the traffic
    budget) to the count each chose. Every figure drawn is a MODEL PREDICTION: the title says so."""
    plt = _plt()
    n = len(panels)
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(WIDTH, 2.6 * rows), squeeze=False)
    for ax, (label, curves) in zip(axes.flat, panels.items()):
        for k, (gpu, (ps, us)) in enumerate(curves.items()):
            color = LINE_COLORS[k % len(LINE_COLORS)]
            ax.plot(ps, us, "-", color=color, lw=1.2, label=f"{gpu} (predicted)")
            pk = picks.get(label, {}).get(gpu, {})
            for what, marker, name in (("rule", "s", "rule of thumb"), ("fastest", "*", "model's fastest"),
                                       ("default", "o", "default (traffic cap)")):
                if what in pk and pk[what] in ps:
                    i = list(ps).index(pk[what])
                    ax.plot([ps[i]], [us[i]], marker, color=color, ms={"*": 11, "o": 5}.get(marker, 7),
                            mfc="white" if marker == "s" else color, mec=color, label=f"{gpu}: {name} P={pk[what]}")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        _style(ax, title=label, xlabel="partitions P", ylabel="predicted µs")
        ax.legend(fontsize=FONT - 1, loc="best")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("PREDICTED by pa_tile.perf.model (not measured)" + (f": {note}" if note else ""), fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def stage_predictions(labels: Sequence[str], series: Mapping[str, Sequence[float]], *, title: str,
                      floors: Optional[Mapping[str, tuple]] = None, reference: Optional[Mapping[str, tuple]] = None,
                      note: str = ""):
    """Predicted kernel time per stage: grouped bars, one series per GPU, each bar labelled.

    ``floors[label] = (µs, series name)``: a time floor (HBM bytes / bandwidth) drawn as a line in
    that series' colour, so no bar can be read as beating it. ``reference[label] = (µs, kind)``:
    bars of one more group at the right (e.g. upstream's kernel), ``kind`` "measured" (black,
    hatched) or a series name (that series' colour): a measured and a predicted time of equal
    height stay two bars side by side, never two lines on top of each other. Everything but a
    "measured" bar is a MODEL PREDICTION: the title says so."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 4.6))
    names = list(series)
    color = {n: LINE_COLORS[k % len(LINE_COLORS)] for k, n in enumerate(names)}
    x = np.arange(len(labels))
    w = 0.8 / max(1, len(series))

    def label_bar(b, v):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=FONT - 1)

    for k, (name, vals) in enumerate(series.items()):
        vals = [np.nan if v is None else v for v in vals]
        bars = ax.bar(x + (k - (len(series) - 1) / 2) * w, vals, w, color=color[name], label=name)
        for b, v in zip(bars, vals):
            if np.isfinite(v):
                label_bar(b, v)
    ticks = list(labels)
    if reference:
        xr = len(labels) + 0.2
        rw = 0.8 / len(reference)
        for k, (name, (v, kind)) in enumerate(reference.items()):
            measured = kind == "measured"
            b = ax.bar(xr + (k - (len(reference) - 1) / 2) * rw, v, rw, label=name,
                       color="white" if measured else color.get(kind, "0.6"), edgecolor=OKABE_ITO[-1],
                       hatch="///" if measured else None, lw=1.0)
            label_bar(b[0], v)
        ticks.append("upstream\n(reference)")
        x = np.append(x, xr)
    for k, (name, (v, series_name)) in enumerate((floors or {}).items()):
        ax.axhline(v, color=color.get(series_name, OKABE_ITO[-1]), lw=1.2, ls=("--", ":", "-.")[k % 3],
                   label=name)
    ax.set_xticks(x)
    ax.set_xticklabels(ticks, fontsize=FONT)
    ax.set_yscale("log")
    _style(ax, title=title, ylabel="µs (log scale)")
    ax.legend(fontsize=FONT - 1, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    if note:
        import textwrap

        ax.text(0.0, -0.48, "\n".join(textwrap.wrap(note, 130)), transform=ax.transAxes, fontsize=FONT - 1,
                va="top")
    fig.tight_layout()
    return fig


def head_dim_split_timeline(m_tiles: int = 4, group: int = 4, v_with_k: bool = False):
    """One tile of the stage-5 loop (P·V split by head_dim), all four waves: K loads (and, with
    ``v_with_k``, V loads right after them), phase A (each M-tile's scores and row max to the max
    table; V loads after the first group's scores when not ``v_with_k``), the max barrier, then
    phase B M-tile by M-tile: the exponentials against the workgroup's max with P to the slab, a
    barrier, P·V of the wave's own d-chunks over all four spans, and (between M-tiles of a phase
    group) the barrier that frees the slab. ``group``: M-tiles per phase group (``PHASE_GROUP``)."""
    plt = _plt()
    kinds = {"load": ("K loads, next page ids", OKABE_ITO[7], 1.0),
             "score": ("phase A: scores, row max → LDS", OKABE_ITO[4], 1.0),
             "vload": ("V loads: own d-chunks, 4 spans", "#999999", 1.0),
             "soft": ("phase B: exp against the shared max, P → LDS", OKABE_ITO[1], 0.9),
             "pv": ("phase B: P·V, own d-chunks, 256 tokens", OKABE_ITO[0], 1.1)}
    fig, ax = plt.subplots(figsize=(WIDTH, 3.4))
    phases, cur = [], [("load", "")] + ([("vload", "")] if v_with_k else [])  # runs between two barriers
    for g0 in range(0, m_tiles, group):
        ms = range(g0, min(g0 + group, m_tiles))
        cur += [("score", f"m{m}") for m in ms] + ([("vload", "")] if g0 == 0 and not v_with_k else [])
        phases.append(cur)
        for i, m in enumerate(ms):
            phases.append([("soft", f"m{m}")])
            cur = [("pv", f"m{m}")]
            if i < len(ms) - 1:
                phases.append(cur)
                cur = []
    phases.append(cur)
    x0 = 0.0
    for k, phase in enumerate(phases):
        ends = []
        for w in range(4):
            x = x0
            for kind, label in phase:
                name, color, width = kinds[kind]
                width += 0.07 * ((w * 3 + k) % 4)  # waves drift apart between barriers
                ax.barh(3 - w, width, left=x, height=0.6, color=color, edgecolor="white")
                if label:
                    ax.text(x + width / 2, 3 - w, label, ha="center", va="center", fontsize=FONT,
                            color="white" if kind in ("load", "score") else "black")
                x += width
            ends.append(x)
        x0 = max(ends) + 0.15  # everyone waits for the slowest wave
        if k < len(phases) - 1:
            ax.plot([x0 - 0.075] * 2, [-0.45, 3.45], "-", color=OKABE_ITO[5], lw=2)
    ax.set_yticks(range(4), [f"wave {w}" for w in (3, 2, 1, 0)])
    ax.set_xticks([])
    handles = _patches([v[0] for v in kinds.values()], [v[1] for v in kinds.values()])
    handles += [plt.Line2D([], [], ls="-", color=OKABE_ITO[5], lw=2, label="s_barrier (whole workgroup)")]
    ax.legend(handles=handles, fontsize=FONT, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    v_when = "V issued with K" if v_with_k else "V issued after the first group's scores"
    _style(ax, f"One tile of the loop: {m_tiles} M-tiles, {min(group, m_tiles)} per phase group, {v_when}",
           None, None)
    ax.set_xlabel("issue order (schematic, not to scale) →", fontsize=FONT)
    fig.tight_layout()
    return fig


def head_dim_split_dataflow(head_dim: int = 128, waves: int = 4, span: int = 64):
    """Who computes what in one tile of the head_dim split, for one M-tile. Left: P, ``[span of
    tokens][query row]``: wave ``w`` computes the P of its own span (tokens ``span·w ..``) and
    writes it to the slab. Right: the output ``O = V·P``, ``[d-chunk][query row]``: wave ``w``
    accumulates d-chunks ``CPW·w .. CPW·w + CPW - 1`` over all four spans, so it reads every
    wave's P from the slab. Colour = the wave that computes the cell."""
    plt = _plt()
    nch = head_dim // 16
    cpw = nch // waves
    colors = OKABE_ITO[:waves]
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.8), gridspec_kw={"width_ratios": [1, 1.6]})
    p_owner = np.repeat(np.arange(waves)[:, None], 16, axis=1)
    axes[0].imshow(p_owner, cmap=_cmap(colors), vmin=-0.5, vmax=waves - 0.5, aspect="auto", interpolation="nearest")
    for w in range(waves):
        axes[0].text(7.5, w, f"wave {w} → slab[{w}]", ha="center", va="center", fontsize=FONT)
    axes[0].set_yticks(range(waves), [f"tokens {span * w}..{span * w + span - 1}" for w in range(waves)])
    axes[0].set_xticks([0, 15], ["row 0", "row 15"])
    _style(axes[0], "P of the tile (fp8): each wave its own span", "query row of the M-tile", None)
    o_owner = np.repeat((np.arange(nch) // cpw)[:, None], 16, axis=1)
    axes[1].imshow(o_owner, cmap=_cmap(colors), vmin=-0.5, vmax=waves - 0.5, aspect="auto", interpolation="nearest")
    for j in range(nch):
        axes[1].text(7.5, j, f"channels {16 * j}..{16 * j + 15}: wave {j // cpw}, P from all {waves} slabs",
                     ha="center", va="center", fontsize=FONT - 1)
    axes[1].set_yticks(range(nch), [f"d-chunk {j}" for j in range(nch)])
    axes[1].set_xticks([0, 15], ["row 0", "row 15"])
    _style(axes[1], f"O = V·P over all {waves * span} tokens (head_dim {head_dim})", "query row of the M-tile", None)
    fig.legend(handles=_patches([f"wave {w}" for w in range(waves)], colors), loc="lower center", ncol=waves,
               fontsize=FONT)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig

def work_layouts(tiles: Sequence[int], layouts: Mapping[str, Sequence[Sequence[tuple]]]):
    """Which workgroup walks each tile of a ragged batch, one panel per layout.

    ``tiles[s]``: sequence s's 256-token tiles; ``layouts[name][s]``: its workgroups as ``(first
    tile, end tile)`` ranges (chapter 07 computes them: the uniform split and the work list). The
    panel's title names its busiest workgroup: the launch lasts at least as long as it does."""
    plt = _plt()
    fig, axes = plt.subplots(len(layouts), 1, figsize=(WIDTH, (0.28 * len(tiles) + 0.9) * len(layouts)),
                             squeeze=False)
    for ax, (name, per_seq) in zip(axes.flat, layouts.items()):
        busiest, count = 0, 0
        for s, ranges in enumerate(per_seq):
            for k, (t0, t1) in enumerate(ranges):
                if t1 <= t0:
                    continue
                count += 1
                busiest = max(busiest, t1 - t0)
                ax.barh(s, t1 - t0, left=t0, height=0.7, color=LINE_COLORS[k % len(LINE_COLORS)], edgecolor="white",
                        lw=0.6)
        ax.set_yticks(range(len(tiles)), [f"seq {s}: {n} tiles" for s, n in enumerate(tiles)], fontsize=FONT - 1)
        ax.invert_yaxis()
        ax.set_xlim(0, max(tiles) * 1.02)
        ax.grid(axis="x", alpha=0.3)
        _style(ax, f"{name}: {count} busy workgroups per KV head, the busiest walks {busiest} tiles",
               "256-token tile" if ax is axes.flat[-1] else None, None)
    fig.tight_layout()
    return fig


def schedule_predictions(rows: Sequence[Mapping], *, note: str = ""):
    """Predicted time of a split's two layouts per batch and GPU, beside the HBM floor.

    ``rows``: dicts with ``batch`` (a label), ``gpu``, ``uniform``, ``balanced`` and ``floor``
    (µs), optionally ``partitions``. Every bar is a MODEL PREDICTION: the title says so."""
    plt = _plt()
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    gpus = list(dict.fromkeys(r["gpu"] for r in rows))
    fig, axes = plt.subplots(1, len(gpus), figsize=(WIDTH, 3.0), squeeze=False)
    for ax, gpu in zip(axes.flat, gpus):
        mine = {r["batch"]: r for r in rows if r["gpu"] == gpu}
        x = np.arange(len(batches))
        for k, (key, label) in enumerate((("uniform", "uniform split"), ("balanced", "balanced (work list)"))):
            vals = [mine[b][key] for b in batches]
            bars = ax.bar(x + (k - 0.5) * 0.38, vals, 0.38, color=LINE_COLORS[k], label=label)
            for b, v in zip(bars, vals):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=FONT - 1)
        ax.plot(x, [mine[b]["floor"] for b in batches], "_", color="black", ms=22, mew=1.5, label="HBM floor")
        ax.set_xticks(x, [b + (f"\nP={mine[b]['partitions']}" if "partitions" in mine[b] else "") for b in batches],
                      fontsize=FONT - 1)
        ax.set_ylim(0, max(max(r["uniform"], r["balanced"]) for r in rows) * 1.15)
        _style(ax, gpu, None, "predicted µs")
        ax.legend(fontsize=FONT - 1, loc="upper right")
    fig.suptitle("PREDICTED by pa_tile.perf.model (not measured)" + (f": {note}" if note else ""), fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def m_tile_predictions(panels: Mapping[str, Mapping[str, tuple]], *, note: str = ""):
    """Predicted time against batch size, one line per M-tiles-per-workgroup cap, one panel per GPU.

    ``panels[gpu][label] = (batches, predicted_us)``; the label says the cap and how many times
    it reads K and V. Every line is a MODEL PREDICTION: the title says so."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(WIDTH, 2.8), squeeze=False)
    for ax, (gpu, curves) in zip(axes.flat, panels.items()):
        for k, (label, (xs, us)) in enumerate(curves.items()):
            ax.plot(xs, us, "o-", color=LINE_COLORS[k % len(LINE_COLORS)], lw=1.2, ms=4, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lo, hi = min(min(u) for _, u in curves.values()), max(max(u) for _, u in curves.values())
        ax.set_yticks([t for t in (25, 50, 100, 200, 400, 800, 1600, 3200) if lo / 2 <= t <= hi * 2],
                      minor=False)
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        xs = next(iter(curves.values()))[0]
        ax.set_xticks(list(xs), [str(x) for x in xs])
        _style(ax, gpu, "sequences (8 KV heads each)", "predicted µs")
        ax.legend(fontsize=FONT - 1, loc="upper left")
    fig.suptitle("PREDICTED by pa_tile.perf.model (not measured)" + (f": {note}" if note else ""), fontsize=FONT + 1)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# chapter 08

def serving_math_map(features: Mapping[str, Sequence[str]]):
    """Where each piece of the serving math runs: one box per place in the finished kernel (the
    main loop, the unsplit epilogue, the split's reduce), listing what it does there.
    ``features[place]`` holds the lines of that box, in order; a line starting ``+`` is one the
    serving math adds (drawn in colour), the others are what the place did before."""
    plt = _plt()
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(WIDTH, 3.0))
    n = len(features)
    width, gap = 0.30, (1.0 - 0.30 * n) / (n + 1)
    for i, (place, lines) in enumerate(features.items()):
        x0 = gap + i * (width + gap)
        ax.add_patch(FancyBboxPatch((x0, 0.05), width, 0.78, boxstyle="round,pad=0.01", fc="#f4f4f4", ec="0.4"))
        ax.text(x0 + width / 2, 0.9, place, ha="center", va="bottom", fontsize=FONT + 1, weight="bold")
        for k, line in enumerate(lines):
            added = line.startswith("+")
            ax.text(x0 + 0.012, 0.76 - 0.1 * k, line.lstrip("+ "), ha="left", va="top", fontsize=FONT,
                    color=OKABE_ITO[5] if added else "0.25", weight="bold" if added else "normal")
        if i < n - 1:
            ax.annotate("", xy=(x0 + width + gap * 0.9, 0.45), xytext=(x0 + width + gap * 0.1, 0.45),
                        arrowprops=dict(arrowstyle="->", color="0.4"))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.axis("off")
    fig.legend(handles=_patches(["what the kernel did before", "what the serving math adds"],
                                ["0.25", OKABE_ITO[5]]), loc="lower center", ncol=2, fontsize=FONT)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def chunkings(tiles: int, cuts: Mapping[str, Sequence[tuple]]):
    """One sequence of ``tiles`` 256-token tiles, cut into chunks in different settings (batch,
    mode): ``cuts[label]`` its chunks as ``(first tile, end tile)``, one row each, a colour per
    chunk. Where its cuts move with the batch, so do its output bits."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 0.42 * len(cuts) + 0.9))
    for row, (label, chunks) in enumerate(cuts.items()):
        for k, (t0, t1) in enumerate(chunks):
            if t1 > t0:
                ax.barh(row, t1 - t0, left=t0, height=0.7, color=LINE_COLORS[k % len(LINE_COLORS)],
                        edgecolor="white", lw=1.2)
                ax.text((t0 + t1) / 2, row, f"{t0}..{t1 - 1}", ha="center", va="center", fontsize=FONT - 1)
    ax.set_yticks(range(len(cuts)), list(cuts), fontsize=FONT)
    ax.invert_yaxis()
    ax.set_xlim(0, tiles)
    ax.grid(axis="x", alpha=0.3)
    _style(ax, f"the watched sequence's {tiles} tiles: one bar per workgroup chunk (tiles first..last)",
           "256-token tile", None)
    fig.tight_layout()
    return fig
