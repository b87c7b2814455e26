"""The simulated ``cuda`` device (``pa_tile.emu.device``) and the executing simulated GPU
(``pa_tile.backend.simulate_gpu(..., execute=True)``): GPU code paths run unchanged on a CPU.

The device must keep torch's device rules (or a chapter that breaks them on an MI300 would pass
here), keep aliasing exact (kernels write through views), and never produce a time."""

import pytest
import torch

import pa_tile
from pa_tile import backend, cache
from pa_tile.emu import device as sim



@pytest.fixture
def dev():
    with sim.simulated_device("gfx942", 304) as st:
        yield st


# ------------------------------------------------------------------------------ the device itself


def test_cuda_tensors_report_the_device_and_live_on_the_host(dev):
    a = torch.arange(6.0, device="cuda").view(2, 3)
    b = torch.zeros(2, 3).to("cuda")
    c = torch.tensor([1, 2, 3], device="cuda")
    for t in (a, b, c, a + b, a.T.contiguous(), torch.empty_like(a), a.new_zeros(4)):
        assert sim.is_device_tensor(t) and t.device == torch.device("cuda", 0) and t.is_cuda
    assert a.data_ptr() == a.host.data_ptr() and a.host.device.type == "cpu"
    assert c.tolist() == [1, 2, 3] and a.sum().item() == 15.0


def test_views_alias_and_in_place_ops_return_their_tensor(dev):
    a = torch.ones(4, 4, device="cuda")
    row = a[1]
    assert row.zero_() is row
    assert a.host[1].abs().sum() == 0 and a.sum().item() == 12.0
    out = torch.empty(4, 4, device="cuda")
    assert torch.add(a, 1.0, out=out) is out and out.host[0, 0] == 2.0
    host = torch.full((4, 4), 5.0)
    a.copy_(host)  # host-to-device copy: two devices in one op is allowed here, as on a GPU
    assert a.host.eq(5.0).all()


def test_torch_device_rules_hold(dev):
    a = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)  # a host tensor in a device op, as an MI300 refuses it
    assert (a * torch.tensor(2.0)).host.eq(2.0).all()  # a 0-dim CPU scalar is allowed
    with pytest.raises(TypeError, match="Tensor.cpu"):
        a.numpy()
    h = a.cpu()
    assert type(h) is torch.Tensor and h.device.type == "cpu"
    h.zero_()
    assert a.host.eq(1.0).all()  # .cpu() copies


def test_device_to_host_reads_are_counted(dev):
    a = torch.ones(3, device="cuda")
    start = len(dev.host_reads)
    b = a * 2 + 1  # device work only
    assert len(dev.host_reads) == start
    b.sum().item(), b.cpu(), b.to("cpu"), b.tolist(), torch.zeros(3).copy_(b), bool((b > 0).all())
    assert len(dev.host_reads) - start == 6, dev.host_reads[start:]


def test_torch_cuda_answers_for_one_gpu_and_has_no_clock(dev):
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    props = torch.cuda.get_device_properties(0)
    assert props.gcnArchName == "gfx942" and props.multi_processor_count == 304
    s = torch.cuda.current_stream()
    with torch.cuda.stream(torch.cuda.Stream()):
        s.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(), end.record()
    with pytest.raises(sim.NoDeviceClock):
        start.elapsed_time(end)
    with pytest.raises(sim.NoDeviceClock):
        torch.cuda.CUDAGraph()


def test_leaving_restores_torch():
    before = (torch.cuda.is_available(), torch.Tensor.cuda)
    with sim.simulated_device("gfx950", 256):
        assert torch.cuda.is_available()
    assert (torch.cuda.is_available(), torch.Tensor.cuda) == before and sim.active() is None
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_a_flydsl_launcher_runs_on_device_tensors_unadapted(dev):
    """A harness written for a GPU: cuda tensors, torch's current stream, the jit launcher and a
    cached ``flyc.compile`` result; the emulator computes on the host bytes."""
    import flydsl.compiler as flyc

    from pa_tile import tiny_kernels

    backend.ensure_backend()
    x = torch.randn(16, 64, device="cuda")
    y = torch.randn(16, 64, device="cuda")
    out = torch.zeros(16, 64, device="cuda")
    tiny_kernels.scale_add(x, y, out, 2.0, torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert torch.allclose(out.cpu(), 2.0 * x.cpu() + y.cpu())
    out.zero_()
    compiled = flyc.compile(tiny_kernels.scale_add, x, y, out, 3.0, torch.cuda.current_stream())
    assert torch.allclose(out.cpu(), 3.0 * x.cpu() + y.cpu())  # the compile call launched once
    out.zero_()
    compiled(x, y, out, 3.0, torch.cuda.current_stream())
    assert torch.allclose(out.cpu(), 3.0 * x.cpu() + y.cpu())


# ------------------------------------------------------------------------------ the executing simulated GPU


def _inputs(case):
    return (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)


@pytest.mark.parametrize("arch,split", [("gfx942", None), ("gfx950", 3)])
def test_paged_decode_runs_on_the_simulated_gpu(arch, split):
    fmt = "fnuz" if arch == "gfx942" else "ocp"
    with backend.simulate_gpu(arch, execute=True) as gpu:
        assert backend.device_for_tensors() == "cuda" and backend.default_arch() == arch
        case = cache.make_case(2, 8, 1, 128, 16, [40, 300], fp8_format=fmt, seed=0, pad_block_id=-1)
        assert case.query.device.type == "cuda"  # make_case follows the backend's device
        out = pa_tile.paged_decode(*_inputs(case), num_partitions=split)
        assert sim.is_device_tensor(out)
        case.assert_matches(out)
        plan = pa_tile.plan(*_inputs(case), num_partitions=split)
        again = torch.empty_like(out)
        k, v = case.k_blocked(), case.v_trans_blocked()
        reads = len(sim.active().host_reads)
        assert plan.run(case.query, k, v, out=again) is again
        pa_tile.paged_decode(case.query, k, v, case.block_tables, case.context_lengths, case.k_scale,
                             case.v_scale, num_partitions=split)
        assert sim.active().host_reads[reads:] == []  # the per-call path never waits for the device
        assert torch.equal(again.cpu(), out.cpu())
    assert all(a == arch for _, a, _ in gpu.launches)
    per_call = 2 if plan.num_partitions > 1 else 1  # the partial kernel, and the reduce when split
    assert len(gpu.launches) == per_call * 3


def test_a_host_tensor_handed_to_the_simulated_gpu_is_refused_before_it_runs():
    with backend.simulate_gpu("gfx942", execute=True) as gpu:
        case = cache.make_case(1, 8, 1, 128, 16, [40], seed=0)
        host_tables = case.block_tables.cpu()
        args = list(_inputs(case))
        args[3] = host_tables
        with pytest.raises(ValueError, match="block_tables"):
            pa_tile.paged_decode(*args)
        host = cache.make_case(1, 8, 1, 128, 16, [40], seed=0, device="cpu")
        with pytest.raises(ValueError, match="cpu tensor was handed to a launch"):
            pa_tile.paged_decode(*_inputs(host))  # every tensor on the host: the boundary refuses
    assert gpu.launches == []


def test_the_other_archs_static_metrics_compile_on_a_simulated_gpu():
    """Chapter 07 compiles every stage for both archs; on a GPU the cases for that must be host
    tensors (compiling reads no device memory), or the other arch is refused for the device."""
    from pa_tile.perf import adapters, stage_metrics

    with backend.simulate_gpu("gfx942", execute=True):
        ad = adapters.get("s2")
        assert ad.make_case(ad.default_shape(batch=1, context=(40,)), "gfx950").query.device.type == "cpu"
        m = stage_metrics.static_metrics("s2", "gfx950", 16)
    assert m.arch == "gfx950" and m.vgpr > 0
