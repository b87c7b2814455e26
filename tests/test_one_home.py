"""One home per fact and per helper (issue #10): one reader of assembly text, one table of arch facts.

* Every reader of assembly (``pa_tile.isa``, ``pa_tile.emu.asm``, ``pa_tile.emu.launch``) goes
  through ``pa_tile.emu.asmtext``: for a compiled listing they report the same kernels, metadata,
  instructions and labels, and nothing else in the package loads YAML.
* The emulator's arch tables are views of ``pa_tile.arch``, for every arch in ``arch.ARCHS``, and
  no emulator module spells a per-arch table of its own; ``pa_tile.emu`` imports only the leaves.
"""

import ast
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from pa_tile import arch, isa, toolchain
from pa_tile.emu import asm, asmtext, launch, memory
from pa_tile.emu import numerics as nx
from pa_tile.tiny_kernels import scale_add

PKG = Path(__file__).resolve().parents[1] / "pa_tile"
LEAVES = {"arch", "fp8", "progress"}


def _modules(root=PKG):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


# --- one reader of assembly text -----------------------------------------------------------------


@pytest.fixture(scope="module", params=arch.ARCHS)
def listing(request):
    """A paged-attention stage (loops, LDS, many labels) and a tiny kernel, compiled for one arch."""
    from pa_tile.perf import adapters

    a = adapters.get(adapters.stage_names()[1])
    stage = a.compile_isa(a.make_case(a.default_shape(batch=1, context=(129,)), request.param), request.param)
    x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
    tiny = toolchain.compile_isa(scale_add, x, y, out, 2.0, arch=request.param)
    return request.param, stage, tiny


def _emu_body(prog, kernel):
    """The emulator's instructions of *kernel*: its entry to its .Lfunc_end, padding dropped."""
    k = prog.kernel(kernel)
    end = min((i for name, i in prog.labels.items() if name.startswith(".Lfunc_end") and i > k.entry),
              default=len(prog.instructions))
    body = prog.instructions[k.entry:end]
    n = len(body)
    while n and body[n - 1].mnemonic in ("s_nop", "s_code_end"):
        n -= 1
    return body[:n] if n < len(body) and n and body[n - 1].mnemonic.startswith("s_endpgm") else body


def _agree(text, single_file=True):
    prog = asm.parse_asm(text)
    meta = launch.parse_amdgpu_metadata(text)
    names = isa.kernel_names(text)
    assert names == list(prog.kernels) == list(meta.kernels) and names
    for i, name in enumerate(names):
        st = isa.IsaStats.from_asm(text, kernel=i)
        k = prog.kernel(name)
        assert st.kernel == name and st.arch == prog.arch == meta.arch
        assert meta.kernels[name].raw == k.metadata  # one metadata document, whoever reads it
        md = k.metadata
        assert (st.vgpr_unified, st.sgpr, st.lds_bytes, st.kernarg_bytes) == (
            md[".vgpr_count"], md[".sgpr_count"], md[".group_segment_fixed_size"], md[".kernarg_segment_size"])
        assert st.lds_bytes == k.desc("group_segment_fixed_size")
        assert st.scratch_bytes == k.desc("private_segment_fixed_size")
        body = _emu_body(prog, name)
        assert st.n_instructions == len(body) > 0
        assert st.mnemonics == dict(Counter(ins.mnemonic.lower() for ins in body))
        if single_file:
            for lp in st.loops:  # loop headers are the emulator's labels, at the same instruction
                assert prog.labels[lp.header] == k.entry + lp.start
                assert body[lp.start].line == lp.start_line and body[lp.end].line == lp.end_line
    return prog


def test_isa_emulator_and_launch_read_a_compiled_listing_alike(listing):
    arch_name, stage, tiny = listing
    prog = _agree(stage)
    assert prog.arch == arch_name and isa.IsaStats.from_asm(stage).loops  # the stage has a loop
    _agree(tiny)


def test_readers_agree_on_concatenated_files(listing):
    _, stage, tiny = listing
    _agree(tiny + "\n" + stage, single_file=False)


def test_one_scanner_of_statements():
    text = ('\t.amdgcn_target "amdgcn-amd-amdhsa--gfx942"\nk:  ; @k\n1: s_nop 0 ; c\n'
            '\tds_swizzle_b32 v1, v0 offset:swizzle(BITMASK_PERM,"01p;i") ; c\n\t.set .Lk.num_vgpr, 3\n'
            '\t.amdhsa_kernel k\n\t\t.amdhsa_next_free_vgpr 3 ; c\n\t.end_amdhsa_kernel\n'
            '\t.amdgpu_metadata\n---\namdhsa.kernels: [{.name: k}]\n...\n\t.end_amdgpu_metadata\n')
    got = list(asmtext.scan(text.splitlines()))
    assert got == [
        (asmtext.DIRECTIVE, 1, ".amdgcn_target", '"amdgcn-amd-amdhsa--gfx942"'),
        (asmtext.LABEL, 2, "k", None),
        (asmtext.LABEL, 3, "1", None),
        (asmtext.INSTRUCTION, 3, "s_nop 0", None),
        (asmtext.INSTRUCTION, 4, 'ds_swizzle_b32 v1, v0 offset:swizzle(BITMASK_PERM,"01p;i")', None),
        (asmtext.DIRECTIVE, 5, ".set", ".Lk.num_vgpr, 3"),
        (asmtext.DESCRIPTOR, 6, "k", [(7, ".amdhsa_next_free_vgpr 3")]),
        (asmtext.METADATA, 13, {"amdhsa.kernels": [{".name": "k"}]}, None),
    ]
    assert asm.AsmSyntaxError is asmtext.AsmSyntaxError
    with pytest.raises(asmtext.AsmSyntaxError, match="line 3: bad .amdgpu_metadata YAML"):
        list(asmtext.scan(["\t.amdgpu_metadata", "a: [", "\t.end_amdgpu_metadata"]))
    assert list(asmtext.scan(["\t.amdgpu_metadata", "a: 1"]))[-1] == (asmtext.UNTERMINATED, 2, ".amdgpu_metadata", None)


def test_only_the_scanner_loads_yaml_or_strips_comments():
    """A second parser of assembly structure would need YAML (metadata) or its own comment rule."""
    yaml_users, comment_strippers = [], []
    for path, tree in _modules():
        rel = path.relative_to(PKG).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "yaml" for a in node.names):
                yaml_users.append(rel)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "yaml":
                yaml_users.append(rel)
            if isinstance(node, ast.FunctionDef) and "strip_comment" in node.name:
                comment_strippers.append(rel)
    assert sorted(set(yaml_users)) == ["emu/asmtext.py"]
    assert comment_strippers == ["emu/asmtext.py"]


# --- one table of arch facts -------------------------------------------------------------------


@pytest.mark.parametrize("a", arch.ARCHS)
def test_emulator_tables_are_the_arch_facts(a):
    info = arch.INFO[a]
    assert memory.LDS_BANKS[a] == info.lds_banks
    assert memory.LDS_MAX_BYTES[a] == info.lds_per_workgroup
    assert memory.WAVE == info.wave_size
    assert memory._phase_model(a, 1, False)[0] == info.lds_banks  # the b32 read's bank model
    assert nx.fp8_format_for_arch(a) == arch.fp8_format(a)
    big = nx.fp8_encode(np.array([1e9], np.float32), a, saturate=True)
    assert float(nx.fp8_decode(big, a)[0]) == arch.fp8_max(a)
    memory.LDS(info.lds_per_workgroup, arch=a)
    with pytest.raises(ValueError, match="exceeds"):
        memory.LDS(info.lds_per_workgroup + 1, arch=a)
    memory.Trace(a)


def test_arch_lists_are_the_arch_module():
    for table in (memory.LDS_BANKS, memory.LDS_MAX_BYTES, nx._ARCH_FP8):
        assert tuple(table) == arch.ARCHS
    assert tuple(launch.SUPPORTED_ARCHS) == tuple(toolchain.SUPPORTED_ARCHS) == arch.ARCHS
    assert launch.DEFAULT_ARCH == arch.ARCHS[0]
    assert set(isa.ARCH_LIMITS) == set(arch.ARCHS)


def test_no_emulator_module_spells_a_per_arch_table():
    """A dict literal keyed by arch names in pa_tile/emu is a second home of arch facts."""
    found = []
    for path, tree in _modules(PKG / "emu"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if len(keys & set(arch.ARCHS)) >= 2:
                    found.append(f"{path.name}:{node.lineno}")
    assert not found, f"per-arch tables outside pa_tile.arch: {found}"


def test_emulator_imports_only_the_leaves():
    bad = []
    for path, tree in _modules(PKG / "emu"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pa_tile"):
                names = [(node.module.split(".") + [a.name for a in node.names])[1]]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("pa_tile.")]
            else:
                continue
            bad += [f"{path.name}:{node.lineno} {n}" for n in names if n not in LEAVES and n != "emu"]
    assert not bad, f"pa_tile.emu imports above the leaves: {bad}"
