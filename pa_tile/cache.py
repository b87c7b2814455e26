"""Paged KV-cache test cases, fp8 helpers and K/V cache layouts.

Everything here is plain torch on the CPU. Three pieces:

* fp8 e4m3 helpers (``quantize_fp8``, ``dequantize``, ``fp8_decode``). gfx942 uses the
  FNUZ flavour (``torch.float8_e4m3fnuz``: exponent bias 8, one NaN code 0x80, no
  infinities, max 240); gfx950 uses OCP (``torch.float8_e4m3fn``: bias 7, NaN codes
  0x7f/0xff, no infinities, max 448). The same bit pattern means different numbers in the
  two formats, so a code tensor stored as ``uint8`` must always travel with its format.
* Layout builders. The *logical* cache is ``[num_blocks, num_kv_heads, block_size,
  head_dim]``; kernels read one of the physical layouts below, built (and inverted) by
  pure index permutations, so a round trip is bit exact for any dtype.
* ``make_case``: a seeded, deterministic ``PagedCase`` with shuffled page ids.

Layouts (element ``[b, h, t, d]`` of the logical cache = token ``t`` of page ``b``,
kv head ``h``, channel ``d``):

=================  ============================================  ==============================
name               shape                                         element of logical [b,h,t,d]
=================  ============================================  ==============================
K plain            [nb, kvh, block_size, head_dim]               [b, h, t, d]
K blocked          [nb, kvh, head_dim//16, block_size, 16]       [b, h, d//16, t, d%16]
V plain            [nb, kvh, head_dim, block_size]               [b, h, d, t]
V trans-blocked    [nb, kvh, block_size//16, head_dim, 16]       [b, h, t//16, d, t%16]
=================  ============================================  ==============================

K blocked keeps 16 consecutive channels of one token in 16 contiguous fp8 bytes (one
128-bit load per lane); V trans-blocked keeps 16 consecutive tokens of one channel together,
the operand order the P·V matmul wants.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import torch

from pa_tile.fp8 import FP8_DTYPES, FP8_MAX, check_fmt, fp8_decode, fp8_dtype, fp8_format_of  # re-exported

__all__ = [
    "FP8_MAX",
    "FP8_DTYPES",
    "RAGGED_CONTEXTS",
    "PagedCase",
    "make_case",
    "fp8_dtype",
    "fp8_format_of",
    "fp8_decode",
    "quantize_fp8",
    "dequantize",
    "amax_scale",
    "LAYOUTS",
    "layout_shape",
    "layout_index",
    "to_k_blocked",
    "from_k_blocked",
    "to_v_plain",
    "from_v_plain",
    "to_v_trans_blocked",
    "from_v_trans_blocked",
]

# ───────────────────────────── fp8 helpers (pa_tile.fp8) ─────────────────────────────

# Context lengths that hit the awkward cases: a single token, a partial first page, an
# exact 256-token tile, and one token past a tile/page multiple.
RAGGED_CONTEXTS = (1, 17, 256, 1027)

ScaleLike = Union[float, int, torch.Tensor]


def _broadcast_scale(scale: ScaleLike, x_shape: torch.Size, name: str = "scale") -> torch.Tensor:
    """A scale that multiplies ``x`` of ``x_shape``: one value, or one per row (last dim)."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return torch.tensor(float(scale), dtype=torch.float32)
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: expected a float or a float32 tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype float32, got {scale.dtype}")
    if scale.numel() == 1:
        return scale.reshape(())
    if tuple(scale.shape) == tuple(x_shape[:-1]):
        return scale.unsqueeze(-1)
    raise ValueError(
        f"{name}: shape {tuple(scale.shape)} is neither a single value nor one per row "
        f"{tuple(x_shape[:-1])} of data shaped {tuple(x_shape)}"
    )


def quantize_fp8(x: torch.Tensor, fmt: str, scale: ScaleLike) -> torch.Tensor:
    """fp8 codes of ``x / scale``, saturated to ±FP8_MAX[fmt], rounded to nearest even.

    ``x``: float tensor, any shape ``[..., n]``. ``scale``: a float, a 0-d/[1] float32
    tensor (per tensor) or a float32 tensor of shape ``x.shape[:-1]`` (one per row, e.g.
    per token). Returns a tensor of dtype ``fp8_dtype(fmt)`` shaped like ``x``.

    Saturation is explicit because torch's own cast does not saturate FNUZ (out-of-range
    values become the NaN code 0x80) while it does saturate OCP. NaN inputs stay NaN.
    """
    fmt = check_fmt(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    s = _broadcast_scale(scale, x.shape).to(x.device)
    lim = FP8_MAX[fmt]
    y = (x.to(torch.float32) / s).clamp(-lim, lim)
    return y.to(FP8_DTYPES[fmt])


def dequantize(codes: torch.Tensor, fmt: Optional[str] = None, scale: ScaleLike = 1.0) -> torch.Tensor:
    """float32 ``decode(codes) * scale``; ``scale`` as in ``quantize_fp8``.

    ``codes``: fp8 dtype, or uint8 together with ``fmt``.
    """
    vals = fp8_decode(codes, fmt)
    return vals * _broadcast_scale(scale, vals.shape).to(vals.device)


def amax_scale(x: torch.Tensor, fmt: str, per_row: bool = False) -> torch.Tensor:
    """Scale that maps the largest |x| onto the largest fp8 magnitude.

    Per tensor: float32 shape [1]. ``per_row``: float32 shape ``x.shape[:-1]`` (the amax
    of each last-dim row, e.g. per (block, kv_head, slot) for a logical cache). An all-zero
    row gets scale 1 so the scale stays finite and positive.
    """
    fmt = check_fmt(fmt)
    a = x.detach().to(torch.float32).abs()
    amax = a.amax(dim=-1) if per_row else a.amax().reshape(1)
    amax = torch.where(amax > 0, amax, torch.full_like(amax, FP8_MAX[fmt]))
    return (amax / FP8_MAX[fmt]).to(torch.float32).contiguous()


# ───────────────────────────── layouts ─────────────────────────────

LAYOUTS = {
    "k_plain": "[num_blocks, kv_heads, block_size, head_dim]  elem [b,h,t,d]",
    "k_blocked": "[num_blocks, kv_heads, head_dim//16, block_size, 16]  elem [b,h,d//16,t,d%16]",
    "v_plain": "[num_blocks, kv_heads, head_dim, block_size]  elem [b,h,d,t]",
    "v_trans_blocked": "[num_blocks, kv_heads, block_size//16, head_dim, 16]  elem [b,h,t//16,d,t%16]",
}


def _need_4d(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name}: expected 4 dims, got shape {tuple(t.shape)}")


def _need_5d_16(t, name, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 5 or t.shape[-1] != 16:
        raise ValueError(f"{name}: expected shape {what} (5 dims, last 16), got {tuple(t.shape)}")


def layout_shape(layout: str, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple:
    """Shape of the named layout (a key of ``LAYOUTS``)."""
    nb, h, bs, d = num_blocks, num_kv_heads, block_size, head_dim
    shapes = {
        "k_plain": (nb, h, bs, d),
        "k_blocked": (nb, h, d // 16, bs, 16),
        "v_plain": (nb, h, d, bs),
        "v_trans_blocked": (nb, h, bs // 16, d, 16),
    }
    if layout not in shapes:
        raise ValueError(f"layout: expected one of {sorted(shapes)}, got {layout!r}")
    return shapes[layout]


def layout_index(layout: str, b: int, h: int, t: int, d: int) -> tuple:
    """Index, in the named layout, of logical element ``[b, h, t, d]``.

    The formula the builders implement, stated once more so tests (and kernel authors)
    can check an address without going through a permutation.
    """
    idx = {
        "k_plain": (b, h, t, d),
        "k_blocked": (b, h, d // 16, t, d % 16),
        "v_plain": (b, h, d, t),
        "v_trans_blocked": (b, h, t // 16, d, t % 16),
    }
    if layout not in idx:
        raise ValueError(f"layout: expected one of {sorted(idx)}, got {layout!r}")
    return idx[layout]


def to_k_blocked(k: torch.Tensor) -> torch.Tensor:
    """Logical ``k`` [nb, kvh, block_size, head_dim] -> K blocked [nb, kvh, head_dim//16, block_size, 16].

    ValueError (naming ``k``) unless head_dim is a multiple of 16. Returns a contiguous copy.
    """
    _need_4d(k, "k")
    nb, h, bs, d = k.shape
    if d % 16:
        raise ValueError(f"k: head_dim (last dim) must be a multiple of 16, got {d}")
    return k.reshape(nb, h, bs, d // 16, 16).permute(0, 1, 3, 2, 4).contiguous()


def from_k_blocked(kb: torch.Tensor) -> torch.Tensor:
    """K blocked [nb, kvh, head_dim//16, block_size, 16] -> logical [nb, kvh, block_size, head_dim]."""
    _need_5d_16(kb, "kb", "[nb, kvh, head_dim//16, block_size, 16]")
    nb, h, d16, bs, _ = kb.shape
    return kb.permute(0, 1, 3, 2, 4).reshape(nb, h, bs, d16 * 16).contiguous()


def to_v_plain(v: torch.Tensor) -> torch.Tensor:
    """Logical ``v`` [nb, kvh, block_size, head_dim] -> V plain [nb, kvh, head_dim, block_size]."""
    _need_4d(v, "v")
    return v.transpose(2, 3).contiguous()


def from_v_plain(vp: torch.Tensor) -> torch.Tensor:
    """V plain [nb, kvh, head_dim, block_size] -> logical [nb, kvh, block_size, head_dim]."""
    _need_4d(vp, "vp")
    return vp.transpose(2, 3).contiguous()


def to_v_trans_blocked(v: torch.Tensor) -> torch.Tensor:
    """Logical ``v`` [nb, kvh, block_size, head_dim] -> V trans-blocked [nb, kvh, block_size//16, head_dim, 16].

    ValueError (naming ``v``) unless block_size is a multiple of 16.
    """
    _need_4d(v, "v")
    nb, h, bs, d = v.shape
    if bs % 16:
        raise ValueError(f"v: block_size (dim 2) must be a multiple of 16, got {bs}")
    return v.reshape(nb, h, bs // 16, 16, d).permute(0, 1, 2, 4, 3).contiguous()


def from_v_trans_blocked(vt: torch.Tensor) -> torch.Tensor:
    """V trans-blocked [nb, kvh, block_size//16, head_dim, 16] -> logical [nb, kvh, block_size, head_dim]."""
    _need_5d_16(vt, "vt", "[nb, kvh, block_size//16, head_dim, 16]")
    nb, h, b16, d, _ = vt.shape
    return vt.permute(0, 1, 2, 4, 3).reshape(nb, h, b16 * 16, d).contiguous()


# ───────────────────────────── cases ─────────────────────────────


@dataclasses.dataclass(frozen=True, eq=False)
class PagedCase:
    """One paged-decode problem, caches in the logical layout.

    Tensors (contiguous, on the device ``make_case`` was given):

    * ``query``           [num_seqs*query_length, num_q_heads, head_dim]  query_dtype;
                          row ``s*query_length + i`` is query ``i`` of sequence ``s``
    * ``k_cache``/``v_cache`` [num_blocks, num_kv_heads, block_size, head_dim]  fp8 dtype
    * ``block_tables``    [num_seqs, max_blocks_per_seq]  int32
    * ``context_lengths`` [num_seqs]  int32
    * ``k_scale``/``v_scale`` float32 [1] (per-tensor) or [num_blocks, num_kv_heads, block_size] (per-token)

    See ``make_case`` for how pages are assigned and what unused entries hold.
    """

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lengths: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    query_length: int
    fp8_format: str
    scales: str
    seed: int
    num_blocks: int
    max_blocks_per_seq: int

    @property
    def query_group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.fp8_format]

    @property
    def per_token(self) -> bool:
        return self.scales == "per-token"

    def reference(self, **kwargs) -> torch.Tensor:
        """``paged_attention_reference`` on this case (kwargs: softmax_scale, sliding_window)."""
        from pa_tile.reference import paged_attention_reference

        return paged_attention_reference(
            self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lengths,
            self.k_scale, self.v_scale, query_length=self.query_length, **kwargs,
        )

    def error_bound(self, **kwargs):
        """``(ref, bound)`` of ``pa_tile.reference.fp8_error_bound`` on this case (kwargs:
        softmax_scale, sliding_window, out_dtype), on the CPU, where outputs are compared."""
        from pa_tile.reference import fp8_error_bound

        ref, bound = fp8_error_bound(
            self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lengths,
            self.k_scale, self.v_scale, query_length=self.query_length, **kwargs,
        )
        return ref.cpu(), bound.cpu()

    def check(self, out: torch.Tensor, **kwargs):
        """``(ok, worst, mean_err)`` of a kernel's output on this case against the float32
        reference, within ``pa_tile.reference.fp8_error_bound`` (kwargs: softmax_scale,
        sliding_window); ``worst`` is the largest error over its bound, ``mean_err`` the mean
        absolute error."""
        from pa_tile.reference import within_bound

        ref, bound = self.error_bound(out_dtype=out.dtype, **kwargs)
        ok, worst = within_bound(out, ref, bound)
        return ok, worst, float((out.float().cpu() - ref).abs().mean())

    def assert_matches(self, out: torch.Tensor, mean_err: Optional[float] = None, **kwargs) -> None:
        """AssertionError unless ``check`` passes and, if given, the mean absolute error is at
        most ``mean_err`` (a bias check: the bound is per element)."""
        ok, worst, mean = self.check(out, **kwargs)
        if not ok:
            raise AssertionError(f"output error is {worst:.3f}x its fp8 bound (or not finite)")
        if mean_err is not None and not mean <= mean_err:
            raise AssertionError(f"mean error {mean:.5f} > {mean_err}")

    def k_blocked(self) -> torch.Tensor:
        return to_k_blocked(self.k_cache)

    def v_plain(self) -> torch.Tensor:
        return to_v_plain(self.v_cache)

    def v_trans_blocked(self) -> torch.Tensor:
        return to_v_trans_blocked(self.v_cache)

    def __repr__(self) -> str:
        ctx = self.context_lengths.tolist()
        return (
            f"PagedCase(seqs={self.num_seqs}, q_heads={self.num_q_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, block_size={self.block_size}, query_length={self.query_length}, "
            f"ctx={ctx}, {self.fp8_format}, {self.scales}, query={self.query.dtype}, "
            f"num_blocks={self.num_blocks}, seed={self.seed})"
        )


def _pos_int(v, name, minimum=1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")
    return v


def make_case(
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lengths: Union[int, Sequence[int]],
    *,
    query_length: int = 1,
    fp8_format: str = "fnuz",
    scales: str = "per-tensor",
    query_dtype: torch.dtype = torch.float16,
    seed: int = 0,
    num_blocks: Optional[int] = None,
    max_blocks_per_seq: Optional[int] = None,
    pad_block_id: Optional[int] = None,
    device=None,
) -> PagedCase:
    """A deterministic paged-decode case (same arguments -> bit-identical tensors).

    * ``device``: where the tensors live; ``None`` is the device kernels run on here
      (``pa_tile.backend.device_for_tensors()``: the GPU on a ROCm machine, else the CPU). Values
      are generated on the CPU either way, so a case is the same on every machine.

    * ``context_lengths``: one int for every sequence, or one per sequence; each must be
      >= ``query_length`` (the queries are the last ``query_length`` positions).
    * Values: query, K and V are drawn N(0, 1) (float32, from a ``torch.Generator`` seeded
      with ``seed``), the query cast to ``query_dtype``, K/V quantized to fp8 ``fp8_format``
      with amax scales so the largest magnitude lands on FP8_MAX (240 FNUZ / 448 OCP):
      one scale for the whole K (and one for V) when ``scales='per-tensor'``, one per
      (block, kv_head, slot) when ``scales='per-token'``. Every slot of every page holds
      finite data, including tail slots past a context length and pages no sequence uses,
      so a kernel that forgets a mask reads plausible garbage rather than zeros.
    * Pages: sequence ``s`` needs ``ceil(L_s / block_size)`` pages. ``num_blocks`` defaults
      to the total needed; the page ids are a random permutation of ``range(num_blocks)``
      handed out in sequence order, so consecutive logical pages are scattered.
    * ``block_tables`` is ``[num_seqs, max_blocks_per_seq]`` int32 (width defaults to the
      largest need). Unused entries (index >= a sequence's page count) hold, by default
      (``pad_block_id=None``), random *valid* page ids: kernels that fetch whole tiles of
      page ids and mask tokens afterwards (as the upstream tile kernel does) stay in bounds.
      Pass ``pad_block_id=-1`` (or any id in [-1, num_blocks)) to fill them with that value
      instead, e.g. -1 so the emulator faults on any stray dereference.
    """
    for name, v in (("num_seqs", num_seqs), ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("block_size", block_size), ("query_length", query_length)):
        _pos_int(v, name)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: {num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    fp8_format = check_fmt(fp8_format, "fp8_format")
    if scales not in ("per-tensor", "per-token"):
        raise ValueError(f"scales: expected 'per-tensor' or 'per-token', got {scales!r}")
    if query_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"query_dtype: expected float16, bfloat16 or float32, got {query_dtype}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")

    if isinstance(context_lengths, int) and not isinstance(context_lengths, bool):
        ctx = [context_lengths] * num_seqs
    else:
        ctx = list(context_lengths)
        if len(ctx) != num_seqs:
            raise ValueError(f"context_lengths: expected one int or {num_seqs} values, got {len(ctx)}")
    for L in ctx:
        _pos_int(L, "context_lengths")
        if L < query_length:
            raise ValueError(f"context_lengths: {L} is shorter than query_length={query_length}")

    pages = [math.ceil(L / block_size) for L in ctx]
    need = sum(pages)
    if num_blocks is None:
        num_blocks = need
    _pos_int(num_blocks, "num_blocks")
    if num_blocks < need:
        raise ValueError(f"num_blocks: {num_blocks} pages cannot hold the {need} the context lengths need")
    width = max(pages)
    if max_blocks_per_seq is None:
        max_blocks_per_seq = width
    _pos_int(max_blocks_per_seq, "max_blocks_per_seq")
    if max_blocks_per_seq < width:
        raise ValueError(f"max_blocks_per_seq: {max_blocks_per_seq} < {width} pages needed by the longest sequence")
    if pad_block_id is not None:
        _pos_int(pad_block_id, "pad_block_id", minimum=-1)
        if pad_block_id >= num_blocks:
            raise ValueError(f"pad_block_id: {pad_block_id} is not a page id (num_blocks={num_blocks})")

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_seqs * query_length, num_q_heads, head_dim, generator=g).to(query_dtype)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = torch.randn(cache_shape, generator=g)
    v = torch.randn(cache_shape, generator=g)
    per_row = scales == "per-token"
    k_scale = amax_scale(k, fp8_format, per_row)
    v_scale = amax_scale(v, fp8_format, per_row)
    k_cache = quantize_fp8(k, fp8_format, k_scale)
    v_cache = quantize_fp8(v, fp8_format, v_scale)

    perm = torch.randperm(num_blocks, generator=g)
    if pad_block_id is None:
        bt = torch.randint(0, num_blocks, (num_seqs, max_blocks_per_seq), generator=g)
    else:
        bt = torch.full((num_seqs, max_blocks_per_seq), pad_block_id, dtype=torch.int64)
    start = 0
    for s, n in enumerate(pages):
        bt[s, :n] = perm[start:start + n]
        start += n

    if device is None:
        from pa_tile import backend

        device = backend.device_for_tensors()
    dev = torch.device(device)
    return PagedCase(
        query=q.contiguous().to(dev),
        k_cache=k_cache.contiguous().to(dev),
        v_cache=v_cache.contiguous().to(dev),
        block_tables=bt.to(torch.int32).contiguous().to(dev),
        context_lengths=torch.tensor(ctx, dtype=torch.int32).to(dev),
        k_scale=k_scale.to(dev),
        v_scale=v_scale.to(dev),
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        query_length=query_length,
        fp8_format=fp8_format,
        scales=scales,
        seed=seed,
        num_blocks=num_blocks,
        max_blocks_per_seq=max_blocks_per_seq,
    )
