"""Every instruction the project's own kernels compile to decodes in pa_tile.emu (decoding only:
the emulator's semantics registry covers all of them, with every operand and modifier form).

Corpus: each stage in ``pa_tile/stages`` at its default shape for gfx942 and gfx950 (through
``pa_tile.perf.adapters``, which knows every stage's inputs) and the tiny demo kernels.
"""

import time

import pytest

from pa_tile.emu import load_program
from pa_tile.emu.machine import decode_kernel
from pa_tile.perf import adapters

ARCHS = ["gfx942", "gfx950"]


def _corpus(arch):
    for name in adapters.stage_names():
        a = adapters.get(name)
        case = a.make_case(a.default_shape(batch=1, context=(129,)), arch)
        yield name, a.compile_isa(case, arch)
    for name, tk in adapters.TINY_KERNELS.items():
        yield f"tiny:{name}", tk().compile_isa(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_every_mnemonic_of_the_project_kernels_decodes(arch):
    seen, kernels = set(), 0
    for name, asm in _corpus(arch):
        prog = load_program(asm)
        for k in prog.kernels:
            decode_kernel(prog, k, arch)   # raises UnsupportedInstruction naming the line
            kernels += 1
        seen |= {i.mnemonic for i in prog.instructions}
    assert kernels >= len(adapters.stage_names()) and len(seen) > 60
