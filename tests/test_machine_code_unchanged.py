"""Off costs nothing: every option added since f22a20f (sinks, soft-cap, LSE, batch invariance,
ragged query rows, pages of 32 and 128, groups to 128, query_length to 8) is a compile-time
specialization, so with each at its default the partial kernel and the reduce compile to the very
instructions they compiled to before any existed. The fingerprints below were recorded at f22a20f
(``pa_tile.isa.instruction_fingerprint``: mnemonics and operands, no metadata), on both archs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pa_tile import toolchain

ROOT = Path(__file__).resolve().parent.parent

#: the FlyDSL the fingerprints were recorded with (another version may schedule differently; the
#: resource tests of test_stage5/test_stage6 pin registers and occupancy on any toolchain)
FLYDSL = "0.5.0"

# (arch, block, head_dim, group, query_length, scales, trans V, window, partitions, schedule, query
# dtype) -> the instructions of the call's kernels at f22a20f
BEFORE = {
    ('gfx942', 16, 128, 8, 1, 'per-tensor', True, 0, 1, None, 'f16'): "b2ed9c43de37f9e0",
    ('gfx942', 64, 64, 16, 2, 'per-token', False, 100, 1, None, 'f16'): "7758cae31bac6aee",
    ('gfx942', 16, 256, 8, 1, 'per-token', True, 0, 3, 'uniform', 'f16'): "66b56cf7bd421278",
    ('gfx942', 16, 128, 8, 4, 'per-tensor', True, 0, 2, 'balanced', 'f16'): "3324eecc3dd11ea9",
    ('gfx942', 64, 128, 16, 4, 'per-token', True, 0, 1, None, 'f16'): "10350b1838cd1525",
    ('gfx942', 16, 64, 8, 2, 'per-token', True, 40, 3, 'uniform', 'f16'): "15d5aa26eebfe7ac",
    ('gfx942', 16, 128, 4, 3, 'per-tensor', True, 0, 4, 'balanced', 'f16'): "830a920b8b0b0015",
    ('gfx942', 64, 256, 32, 1, 'per-tensor', True, 100, 2, 'balanced', 'f16'): "e54ef858145af77e",
    ('gfx950', 16, 128, 8, 1, 'per-tensor', True, 0, 1, None, 'f16'): "526f8d2b253f8ac3",
    ('gfx950', 64, 64, 16, 2, 'per-token', False, 100, 1, None, 'f16'): "fe776f29912b4b85",
    ('gfx950', 16, 256, 8, 1, 'per-token', True, 0, 3, 'uniform', 'f16'): "5b9bd8b4744622f7",
    ('gfx950', 16, 128, 8, 4, 'per-tensor', True, 0, 2, 'balanced', 'f16'): "a39bf8066fcd80e0",
    ('gfx950', 64, 128, 16, 4, 'per-token', True, 0, 1, None, 'f16'): "1414ec6a8837b005",
    ('gfx950', 16, 64, 8, 2, 'per-token', True, 40, 3, 'uniform', 'f16'): "6d75925bf3958413",
    ('gfx950', 16, 128, 4, 3, 'per-tensor', True, 0, 4, 'balanced', 'f16'): "3703f88c8fb7bb89",
    ('gfx950', 64, 256, 32, 1, 'per-tensor', True, 100, 2, 'balanced', 'f16'): "c0d3bf056c888432",
    ('gfx942', 16, 64, 16, 4, 'per-token', False, 0, 1, None, 'bf16'): "b555241ff2fad306",
    ('gfx942', 64, 128, 8, 1, 'per-tensor', True, 0, 1, None, 'bf16'): "269b10ce62a17709",
    ('gfx950', 16, 256, 8, 2, 'per-token', True, 0, 1, None, 'bf16'): "7e17feb8d7a96c0b",
    ('gfx950', 64, 256, 8, 2, 'per-token', True, 0, 1, None, 'bf16'): "8df2273c7404d364",
}


#: what the fresh process runs: each configuration's call compiled, its fingerprint printed
COMPILE = """
import json, sys, torch
from pa_tile import cache, isa, toolchain
from pa_tile.stages import s6_split_k as s6
FMT = {"gfx942": "fnuz", "gfx950": "ocp"}
out = {}
for cfg in json.loads(sys.argv[1]):
    arch, bs, hd, g, ql, scales, trans_v, window, parts, schedule, qd = cfg
    case = cache.make_case(2, g, 1, hd, bs, [300, 40], query_length=ql, fp8_format=FMT[arch], scales=scales,
                           query_dtype=torch.bfloat16 if qd == "bf16" else torch.float16, device="cpu")
    v = case.v_trans_blocked() if trans_v else case.v_plain()
    fn, args, _ = s6.launch_args(case.query, case.k_blocked(), v, case.block_tables, case.context_lengths,
                                 case.k_scale, case.v_scale, arch=arch, sliding_window=window,
                                 num_partitions=parts, schedule=schedule)
    out[repr(tuple(cfg))] = isa.instruction_fingerprint(toolchain.compile_isa(fn, *args, arch=arch))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fingerprints():
    """Every configuration compiled in one fresh interpreter, as a user's process compiles it: no
    kernel built, run or patched earlier in the test process can touch what is compiled. (One
    full-suite run, 2026-12-07, saw five split configurations fingerprint otherwise in a worker
    that had run other test files first; no ordering tried since reproduced it.)"""
    arg = json.dumps([list(c) for c in BEFORE])
    proc = subprocess.run([sys.executable, "-c", COMPILE, arg], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PA_TILE_PROGRESS": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(toolchain.describe_toolchain()["flydsl"] != FLYDSL,
                    reason="the fingerprints are of another FlyDSL version")
@pytest.mark.parametrize("cfg", list(BEFORE), ids=lambda c: "-".join(map(str, c)))
def test_defaults_compile_to_the_instructions_of_before(cfg, fingerprints):
    assert fingerprints[repr(cfg)] == BEFORE[cfg]
