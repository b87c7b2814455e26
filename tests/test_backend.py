"""The gpu/emu switch: env var, set_backend(), auto-detection, and what each choice implies."""

import types

import pytest
import torch

from pa_tile import backend


@pytest.fixture(autouse=True)
def clean_choice(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.delenv("ARCH", raising=False)
    monkeypatch.delenv("FLYDSL_GPU_ARCH", raising=False)
    backend.set_backend(None)
    yield
    backend.set_backend(None)


@pytest.fixture
def fake_rocm_gpu(monkeypatch):
    """Pretend torch is a ROCm build that sees an MI300X (and the emulator hook is not in yet)."""
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-")
    )
    monkeypatch.setattr(backend, "_emulator_installed", lambda: False)


def test_this_machine_has_no_gpu_so_auto_means_emu():
    assert not backend.gpu_available()  # CPU torch: torch.version.hip is None
    assert backend.current_backend() == "emu"
    assert backend.device_for_tensors() == "cpu"


def test_auto_picks_the_gpu_when_a_rocm_torch_sees_one(fake_rocm_gpu):
    assert backend.gpu_available()
    assert backend.current_backend() == "gpu"
    assert backend.device_for_tensors() == "cuda"
    assert backend.default_arch() == "gfx942"  # feature suffixes stripped


def test_cuda_torch_is_not_a_rocm_gpu(fake_rocm_gpu, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert not backend.gpu_available() and backend.current_backend() == "emu"


def test_env_var_and_set_backend_override_detection(fake_rocm_gpu, monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "emu")
    assert backend.current_backend() == "emu"
    backend.set_backend("gpu")  # set_backend beats the environment
    assert backend.current_backend() == "gpu"
    backend.set_backend(None)
    assert backend.current_backend() == "emu"
    monkeypatch.setenv(backend.ENV_VAR, " AUTO ")
    assert backend.current_backend() == "gpu"


@pytest.mark.parametrize("installed", [False, True])
def test_asking_for_the_gpu_without_one_raises(monkeypatch, installed):
    monkeypatch.setattr(backend, "_emulator_installed", lambda: installed)
    monkeypatch.setenv(backend.ENV_VAR, "gpu")
    with pytest.raises(backend.BackendError, match="PA_TILE_BACKEND=gpu.*torch.version.hip"):
        backend.current_backend()
    with pytest.raises(backend.BackendError):
        backend.ensure_backend()
    if not installed:
        monkeypatch.delenv(backend.ENV_VAR)
        backend.set_backend("gpu")
        with pytest.raises(backend.BackendError, match="set_backend\\(\\) asks for the GPU"):
            backend.device_for_tensors()


def test_bad_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="'cuda' is not one of gpu, emu, auto"):
        backend.set_backend("cuda")
    with pytest.raises(TypeError):
        backend.set_backend(1)
    monkeypatch.setenv(backend.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="PA_TILE_BACKEND='tpu'"):
        backend.current_backend()


def test_default_arch_on_the_emulator(monkeypatch):
    assert backend.default_arch() == "gfx942"
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx950")
    assert backend.default_arch() == "gfx950"
    monkeypatch.setenv("ARCH", "gfx942")  # ARCH wins: it is what FlyDSL compiles for
    assert backend.default_arch() == "gfx942"


def test_ensure_backend_installs_the_emulator_and_then_the_gpu_is_off_limits():
    from flydsl.compiler import backends as flydsl_backends

    from pa_tile.emu import launch

    assert backend.ensure_backend() == "emu"
    assert launch.is_installed()
    assert getattr(flydsl_backends._registry["rocm"], "pa_tile_emulator", False)
    assert backend.ensure_backend() == "emu"  # idempotent
    with pytest.raises(backend.BackendError, match="already installed"):
        backend.set_backend("gpu")


def test_once_installed_auto_stays_on_the_emulator(fake_rocm_gpu, monkeypatch):
    monkeypatch.setattr(backend, "_emulator_installed", lambda: True)
    assert backend.current_backend() == "emu"
    monkeypatch.setenv(backend.ENV_VAR, "gpu")
    with pytest.raises(backend.BackendError, match="already installed"):
        backend.current_backend()


def test_missing_gpu_is_named_first_whatever_ran_before(monkeypatch):
    # The message must not depend on whether an earlier caller installed the emulator hook
    # (the CLI's "--backend gpu" check failed only after other tests had installed it).
    for installed in (False, True):
        monkeypatch.setattr(backend, "_emulator_installed", lambda: installed)
        backend.set_backend(None)
        with pytest.raises(backend.BackendError, match="no usable ROCm GPU") as info:
            backend.set_backend("gpu")
            backend.current_backend()
        assert ("already installed" in str(info.value)) == installed
