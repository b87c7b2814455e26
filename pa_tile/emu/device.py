"""A ``cuda`` device whose memory is the host's: GPU code paths run unchanged, the emulator computes.

Inside :class:`simulated_device` (or after :func:`enter`), ``torch.empty(..., device="cuda")``,
``t.to("cuda")``, ``t.cuda()`` and every op on such tensors work on a CPU-only torch:

* a **device tensor** (:class:`DeviceTensor`) reports ``device='cuda:0'`` and keeps its bytes in
  an ordinary CPU tensor (``.host``); ops on it run on ``.host`` and return device tensors, views
  stay views of the same host bytes, in-place ops and ``out=`` return the tensor they were given;
* torch's **device rules** hold: an op that mixes a device tensor with a CPU tensor that is not a
  0-dim scalar raises as on a GPU, ``.numpy()`` needs ``.cpu()`` first, ``.cpu()`` / ``.to("cpu")``
  copy to an ordinary tensor;
* ``torch.cuda``'s host API answers for one GPU (``is_available``, ``device_count``,
  ``get_device_properties`` with the arch's ``gcnArchName`` and CU count, streams, ``synchronize``);
  work is synchronous, so streams and events order nothing. **No time is ever measured**:
  ``Event.elapsed_time`` and graph capture raise, because a simulated device has no clock.
* FlyDSL launches (``@flyc.jit``, ``flyc.compile``, ``CompiledFunction``) given device tensors run
  in the emulator on their host bytes (``pa_tile.emu.launch`` swaps each device tensor for its
  ``.host`` before FlyDSL sees it), so a harness written for a GPU runs here with no adaptation.

It is a stand-in for the device, not for a GPU's numerics: torch ops compute on the CPU.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["DeviceTensor", "simulated_device", "enter", "exit", "active", "to_host", "is_device_tensor",
           "NoDeviceClock", "allocation_containing"]

DEVICE = torch.device("cuda", 0)
_CPU = torch.device("cpu")

# ops that legitimately take tensors on two devices (torch's own exceptions to "one device per op")
_CROSS_DEVICE = {
    "aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::copy",
    "aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_",
    "aten::_unsafe_index.Tensor", "aten::_unsafe_index_put",
}


class NoDeviceClock(RuntimeError):
    """A simulated device has no clock: nothing run on it can be timed."""


class DeviceTensor(torch.Tensor):
    """A tensor on the simulated ``cuda`` device; ``.host`` holds its bytes (same shape, strides and
    storage offset)."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls, host.size(), strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            layout=host.layout, device=_CPU, requires_grad=host.requires_grad)
        # torch's C++ side sees a storage-less CPU tensor (a CPU-only torch has no device guard for
        # cuda, and scalars it wraps into tensors must keep their values); Python sees cuda:0
        t.host = host
        _remember(host)
        return t

    @property
    def device(self) -> torch.device:
        return DEVICE

    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)
    is_meta = property(lambda self: False)

    def cpu(self, memory_format=torch.preserve_format):
        _count_sync("Tensor.cpu")
        return self.host.clone(memory_format=memory_format)  # a copy into host memory, as from a GPU

    def tolist(self):
        _count_sync("Tensor.tolist")
        return self.host.tolist()  # a device-to-host copy, as torch does for a cuda tensor

    def numpy(self, *args, **kwargs):
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    # Python-level accessors a wrapper does not have: the host bytes are the device memory
    def data_ptr(self) -> int:
        return self.host.data_ptr()

    def untyped_storage(self):
        return self.host.untyped_storage()

    def __repr__(self, *, tensor_contents=None) -> str:
        text = repr(self.host)
        return text[:-1] + f", device='{self.device}')" if text.endswith(")") else text


# Live device memory, for raw-pointer launches: the host tensor of every live device tensor, by id
# (a weak reference each; an id-keyed dict, since tensors compare element-wise).
_LIVE: dict = {}


def _remember(host: torch.Tensor) -> None:
    key = id(host)
    _LIVE[key] = weakref.ref(host, lambda _ref, key=key: _LIVE.pop(key, None))


def allocation_containing(address: int) -> Optional[tuple]:
    """``(base, nbytes)`` of the live device allocation (a device tensor's storage) holding
    *address*, or None: what a raw ``data_ptr()`` handed to a launch may reach, as on a GPU."""
    for ref in list(_LIVE.values()):
        host = ref()
        if host is None:
            continue
        storage = host.untyped_storage()
        base, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes and base <= address < base + nbytes:
            return base, nbytes
    return None


def is_device_tensor(t: Any) -> bool:
    return isinstance(t, DeviceTensor)


def to_host(value: Any) -> Any:
    """``value`` with every device tensor replaced by its host tensor and every stream by ``None``
    (also inside tuples, lists and dicts): what a launch hands the emulator."""
    if isinstance(value, DeviceTensor):
        return value.host
    if isinstance(value, _Stream):
        return None  # the emulator runs every launch at once, on its one (default) stream
    if isinstance(value, (list, tuple)):
        mapped = [to_host(v) for v in value]
        return type(value)(mapped) if not hasattr(value, "_fields") else type(value)(*mapped)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    return value


def _count_sync(what: str) -> None:
    """A device-to-host read: on a GPU the host waits for the device here (a sync)."""
    if _state is not None:
        _state.host_reads.append(what)


def _is_sim(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _dispatch(func, args, kwargs):
    name = func._schema.name + ("." + func._schema.overload_name if func._schema.overload_name else "")
    device_kw = kwargs.get("device")
    wrapped, plain = [], []

    def scan(x):
        if isinstance(x, DeviceTensor):
            wrapped.append(x)
        elif isinstance(x, torch.Tensor):
            plain.append(x)
        return x

    tree_map(scan, (args, kwargs))
    if wrapped and func._schema.name not in _CROSS_DEVICE and name not in _CROSS_DEVICE:
        for p in plain:
            if p.dim() > 0 and p.device.type == "cpu":
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, {DEVICE} and cpu! (simulated device; op {name})")
    if device_kw is not None:
        to_device = _is_sim(device_kw)
    else:
        to_device = bool(wrapped)
    host_kwargs = dict(kwargs)
    if device_kw is not None and _is_sim(device_kw):
        host_kwargs["device"] = _CPU
    if host_kwargs.get("pin_memory"):
        host_kwargs["pin_memory"] = False  # host memory is the device memory: nothing to pin
    host_args = tree_map(lambda x: x.host if isinstance(x, DeviceTensor) else x, args)
    host_kwargs = tree_map(lambda x: x.host if isinstance(x, DeviceTensor) else x, host_kwargs)
    out = func(*host_args, **host_kwargs)
    plain_ids = {id(p) for p in plain}
    if wrapped and (not to_device or func._schema.name in _VALUE_OPS
                    or any(id(x) in plain_ids for x in _tensors(out))):
        _count_sync(name)  # a value or a copy leaves the device: on a GPU the host waits here
    if not to_device:
        return out
    by_host = {id(w.host): w for w in wrapped}

    def wrap(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor):
            if id(x) in plain_ids:
                return x  # written in place on the host (a copy from the device)
            same = by_host.get(id(x))  # an in-place op or out=: the tensor the caller gave
            return same if same is not None else DeviceTensor(x)
        return x

    return tree_map(wrap, out)


_VALUE_OPS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}


def _tensors(out):
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, out)
    return found


class _Mode(TorchDispatchMode):
    """Routes factories with ``device="cuda"`` and copies to ``cuda`` onto the host."""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DeviceTensor) for t in types_) or _is_sim(kwargs.get("device")):
            return _dispatch(func, args, kwargs)
        return func(*args, **kwargs)


class _Constructors(TorchFunctionMode):
    """``torch.tensor(data, device="cuda")`` and its kin build on the host before any dispatch (a
    CPU-only torch refuses the device there), so they are caught a level higher."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_DATA and _is_sim(kwargs.get("device")):
            out = func(*args, **dict(kwargs, device=_CPU))
            return DeviceTensor(out) if not isinstance(out, DeviceTensor) else out
        if func is torch.Tensor.to:
            return _to(args[0], args[1:], kwargs)
        return func(*args, **kwargs)


def _to(self, args, kwargs):
    """``Tensor.to`` in all its forms, to or from the simulated device."""
    if args and isinstance(args[0], torch.Tensor):  # .to(other): other's device and dtype
        device, dtype = args[0].device, args[0].dtype
    else:
        device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
    on_device = isinstance(self, DeviceTensor)
    src = self.host if on_device else self
    to_sim = _is_sim(device) if device is not None else on_device
    res = src.to(device=_CPU, dtype=dtype or src.dtype, copy=bool(kwargs.get("copy", False)))
    if to_sim:
        if res is src and on_device:
            return self  # already there: torch returns the tensor itself
        return DeviceTensor(res if res is not src else src.clone())
    if on_device:
        _count_sync("Tensor.to")  # a copy into host memory, as .cpu()
        return res if res is not src else src.clone()
    return res


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}

# ------------------------------------------------------------------------------- torch.cuda's host API


class _Stream:
    """A stream of the simulated device: work runs at once, so it orders nothing."""

    cuda_stream = 0
    device = DEVICE

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        raise NoDeviceClock("torch.cuda.Event.elapsed_time on a simulated device: it has no clock, so "
                            "nothing run on it can be timed (timings need a GPU)")


class _Graph:
    def __init__(self, *args, **kwargs):
        raise NoDeviceClock("torch.cuda.CUDAGraph on a simulated device: graph capture needs a GPU")


class _State:
    def __init__(self, arch: str, cu_count: int, name: str):
        self.arch, self.cu_count, self.name = arch, cu_count, name
        self.mode: Optional[_Mode] = None
        self.constructors: Optional[_Constructors] = None
        self.saved: dict = {}
        self.host_reads: list = []  # every device-to-host read (a host sync on a GPU), by what did it


_state: Optional[_State] = None


def _cuda_api(st: _State) -> dict:
    props = types.SimpleNamespace(name=st.name, gcnArchName=st.arch, multi_processor_count=st.cu_count,
                                  total_memory=192 << 30, major=9, minor=4, warp_size=64)
    return {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),
        "set_stream": lambda stream: None,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "Stream": _Stream,
        "Event": _Event,
        "CUDAGraph": _Graph,
        "get_device_properties": lambda device=None: props,
        "get_device_name": lambda device=None: st.name,
        "get_device_capability": lambda device=None: (9, 4),
        "empty_cache": lambda: None,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
    }


def active() -> Optional[_State]:
    """The simulated device's state while one is entered: ``arch``, ``cu_count``, ``name`` and
    ``host_reads`` (each device-to-host read so far: ``.item()``, ``.cpu()``, ``.tolist()``, a copy
    to a host tensor; on a GPU each is a host sync)."""
    return _state


def enter(arch: str = "gfx942", cu_count: int = 304, name: str = "simulated AMD GPU") -> _State:
    """Make ``cuda`` the simulated device for the rest of the process (or until :func:`exit`)."""
    global _state
    if _state is not None:
        if (_state.arch, _state.cu_count) != (arch, cu_count):
            raise RuntimeError(f"a simulated {_state.arch} device is already active")
        return _state
    st = _State(arch, cu_count, name)
    for attr, fn in _cuda_api(st).items():
        st.saved[attr] = getattr(torch.cuda, attr, None)
        setattr(torch.cuda, attr, fn)
    st.saved["Tensor.cuda"] = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kw: self.to(DEVICE)
    st.mode, st.constructors = _Mode(), _Constructors()
    st.mode.__enter__()
    st.constructors.__enter__()
    _state = st
    return st


def exit() -> None:  # noqa: A001 - the pair of enter()
    global _state
    st = _state
    if st is None:
        return
    st.constructors.__exit__(None, None, None)
    st.mode.__exit__(None, None, None)
    torch.Tensor.cuda = st.saved.pop("Tensor.cuda")
    for attr, fn in st.saved.items():
        if fn is None:
            delattr(torch.cuda, attr)
        else:
            setattr(torch.cuda, attr, fn)
    _state = None


@contextlib.contextmanager
def simulated_device(arch: str = "gfx942", cu_count: int = 304, name: str = "simulated AMD GPU"):
    """``with simulated_device("gfx950", 256): ...``: ``cuda`` tensors inside are host-backed."""
    was = _state
    st = enter(arch, cu_count, name)
    try:
        yield st
    finally:
        if was is None:
            exit()
