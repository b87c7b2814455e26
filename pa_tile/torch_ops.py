"""``torch.ops.pa_tile.paged_decode``: the finished kernel as a PyTorch op, registered by ``import pa_tile``.

This module imports torch and nothing of pa_tile's: registering the op costs microseconds, and
the kernels, FlyDSL and the validation load on the op's first call (``pa_tile.api``).

The op is what traced code runs: ``pa_tile.paged_decode`` and ``Plan.run`` call it while PyTorch
traces them (``torch.compile``, ``FakeTensorMode``), passing the caller's arguments as they are,
so nothing data-dependent, no partition table and no device query enters the traced region. The
real implementation plans (validation, partition choice, workspace) and launches outside it; the
fake one validates the metadata, so a bad argument is named at trace time. It is defined with
``torch.library.Library`` rather than ``custom_op``: the same schema, functionalization and fake,
without custom_op's Python wrapper around every call (its host cost was most of the op's).

Arguments as ``pa_tile.paged_decode``, with the scales as float32 tensors and ``out`` given; it
mutates ``out``, ``workspace`` (``None``: the call allocates its own) and ``lse`` (given: the
call writes the log-sum-exp there, ``return_lse=True``).
"""

from __future__ import annotations

import torch

__all__ = ["SCHEMA"]

SCHEMA = ("paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
          "Tensor context_lengths, Tensor key_scale, Tensor value_scale, Tensor(a!) out, "
          "Tensor(b!)? workspace=None, float? softmax_scale=None, int sliding_window=0, "
          "int? query_length=None, int? num_partitions=None, int? m_tiles=None, str? arch=None, "
          "str? schedule=None, int? chunk_tiles=None, Tensor? sinks=None, "
          "float? logits_soft_cap=None, Tensor(c!)? lse=None, bool batch_invariant=False, "
          "Tensor? query_start_loc=None) -> ()")


def _impl(*args, **kwargs) -> None:
    from pa_tile import api

    api.op_impl(*args, **kwargs)


def _fake(*args, **kwargs) -> None:
    from pa_tile import api

    api.op_fake(*args, **kwargs)


_lib = torch.library.Library("pa_tile", "DEF")
_lib.define(SCHEMA)
# one kernel for every device: the implementation launches on the tensors' own (CPU: the emulator)
_lib.impl("paged_decode", _impl, "CompositeExplicitAutograd")
torch.library.register_fake("pa_tile::paged_decode", _fake, lib=_lib)
