"""The walkthrough's kernels, one module per chapter, each GENERATED from its notebook.

Every stage module exposes the same launcher::

    paged_decode(query, key_cache, value_cache, block_tables, context_lengths,
                 key_scale, value_scale, *, softmax_scale=None, out=None, arch=None) -> out

so tests, the CLI and the benchmarks can swap stages. ``get(name)`` imports one on demand.
"""

import importlib

#: short name -> (module, the notebook it is exported from, or a tuple of them in module order)
STAGES = {
    "s1": ("pa_tile.stages.s1_tile_qk", "01_tile_qk"),
    "s2": ("pa_tile.stages.s2_register_softmax", "02_register_softmax"),
    "s3": ("pa_tile.stages.s3_raw_loads", "03_raw_dwordx4_loads"),
    "s4": ("pa_tile.stages.s4_blocked_layouts", "04_blocked_layouts"),
    # taught over two chapters; the register-resident baseline it is measured against in an appendix
    "s5": ("pa_tile.stages.s5_phase_split_mtp",
           ("05_phase_split_mtp", "06_head_dim_split_pv", "appendix_register_resident_loop")),
    "s6": ("pa_tile.stages.s6_split_k", "07_split_k_and_the_finished_kernel"),
}


def available() -> list:
    """Stage names whose module exists in this checkout."""
    import importlib.util

    return [k for k, (mod, _) in STAGES.items() if importlib.util.find_spec(mod) is not None]


def get(name: str):
    """The stage module for a short name (``"s1"``) or a module name (``"s1_tile_qk"``)."""
    if not isinstance(name, str):
        raise TypeError(f"stage must be a str such as 's1', got {type(name).__name__}")
    for short, (mod, _) in STAGES.items():
        if name in (short, mod, mod.rsplit(".", 1)[1]):
            if short not in available():
                raise ValueError(f"stage {name!r} is not built in this checkout (available: {available()})")
            return importlib.import_module(mod)
    raise ValueError(f"unknown stage {name!r}; known: {list(STAGES)}")
