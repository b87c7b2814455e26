"""The CPU toolchain compiles a real FlyDSL kernel to gfx942 and gfx950 assembly."""

import os
from pathlib import Path

import pytest
import torch

from pa_tile import toolchain
from pa_tile.tiny_kernels import scale_add


@pytest.fixture(scope="module")
def tensors():
    return torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_compile_isa_targets_the_requested_arch(arch, tensors):
    asm = toolchain.compile_isa(scale_add, *tensors, 2.0, arch=arch)
    assert f'.amdgcn_target "amdgcn-amd-amdhsa-unknown-{arch}"' in asm
    assert "scale_add_kernel" in asm
    # the kernel loads X and Y with one 128-bit load each and stores 128 bits per thread
    assert asm.count("global_load_dwordx4") == 2
    assert asm.count("global_store_dwordx4") == 1
    assert "s_endpgm" in asm and ".amdgpu_metadata" in asm


def test_switching_arch_in_one_process_recompiles(tensors):
    a = toolchain.compile_isa(scale_add, *tensors, 2.0, arch="gfx950")
    b = toolchain.compile_isa(scale_add, *tensors, 2.0, arch="gfx942")
    assert "gfx950" in a and "gfx942" in b and "gfx950" not in b.split("\n")[0]


def test_compile_leaves_environment_untouched(tensors):
    before = {k: os.environ.get(k) for k in ("ARCH", "COMPILE_ONLY", "FLYDSL_DEBUG_DUMP_ASM", "FLYDSL_GPU_ARCH")}
    toolchain.compile_isa(scale_add, *tensors, 1.0, arch="gfx942")
    assert {k: os.environ.get(k) for k in before} == before


def test_bad_arch_is_rejected_by_name(tensors):
    with pytest.raises(ValueError, match="arch"):
        toolchain.compile_isa(scale_add, *tensors, 1.0, arch="gfx90a")
    with pytest.raises(TypeError, match="arch"):
        toolchain.check_arch(942)


def test_prepared_toolchain_is_rocm_shaped(tmp_path):
    root = toolchain.prepare_cpu_toolchain(tmp_path / "rocm")
    assert toolchain.is_rocm_root(root)
    assert os.access(root / "llvm" / "bin" / "ld.lld", os.X_OK)
    # symlinks only: nothing is copied out of (or into) a real install
    assert (root / "llvm" / "bin" / "ld.lld").is_symlink()
    assert (root / "amdgcn" / "bitcode").is_symlink()


def test_is_rocm_root_rejects_incomplete_folders(tmp_path):
    (tmp_path / "llvm" / "bin").mkdir(parents=True)
    (tmp_path / "llvm" / "bin" / "ld.lld").write_text("")
    assert not toolchain.is_rocm_root(tmp_path)  # no bitcode
    assert not toolchain.is_rocm_root(None)


def test_missing_parts_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "_find_lld", lambda: None)
    monkeypatch.setattr(toolchain, "_ziglang_lld_wrapper", lambda d: None)
    monkeypatch.setattr(toolchain, "_find_bitcode_dir", lambda: None)
    with pytest.raises(toolchain.ToolchainError, match="ld.lld.*ockl"):
        toolchain.prepare_cpu_toolchain(tmp_path / "x")


def _fake_conda_env(root, bitcode_dir):
    (root / "bin").mkdir(parents=True)
    lld = root / "bin" / "ld.lld"
    lld.write_text("#!/bin/sh\n")
    lld.chmod(0o755)
    bc = root / bitcode_dir
    bc.mkdir(parents=True)
    for lib in ("ockl", "ocml"):
        (bc / f"{lib}.bc").write_bytes(b"BC")
    return lld, bc


# conda-forge's rocm-device-libs: the real files under lib/clang/<llvm>/..., <prefix>/amdgcn a link
@pytest.mark.parametrize("bitcode_dir", ["lib/clang/20/lib/amdgcn/bitcode", "amdgcn/bitcode"])
def test_finder_uses_the_conda_environment(tmp_path, monkeypatch, bitcode_dir):
    env = tmp_path / "conda-env"
    lld, bc = _fake_conda_env(env, bitcode_dir)
    monkeypatch.setenv("CONDA_PREFIX", str(env))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # an unactivated env: its bin/ is not on PATH
    root = toolchain.prepare_cpu_toolchain(tmp_path / "rocm")
    assert (root / "llvm" / "bin" / "ld.lld").resolve() == lld.resolve()
    assert (root / "amdgcn" / "bitcode").resolve() == bc.resolve()
    assert toolchain.is_rocm_root(root)
