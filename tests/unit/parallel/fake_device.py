"""A fake accelerator for CPU-only CI: every tensor lives on device "fakecuda", none holds data.

Why not the name "cuda": a CPU-only torch build cannot run autograd on cuda-typed tensors (the
engine asks the CUDA hooks for streams), so the fake device is torch's PrivateUse1 backend renamed
"fakecuda", with a no-op stream/event module, under FakeTensorMode (shapes, dtypes and devices are
computed; no memory is allocated). It catches what a GPU would refuse:
  * a CPU tensor mixed into device math (FakeTensorMode raises FakeTensorDeviceMismatchError;
    0-dim CPU scalars are allowed, as on CUDA),
  * a collective on a host tensor (NCCL/XCCL take device tensors only): `CheckedFakeMode` fails it,
  * and it records every collective's op and tensor dtypes for the test to inspect.
A host read (`.item()`, `.tolist()`) has no data to read: it returns 1 (1.0 for floats).
Use it in a forked child (optimus.testing.in_forked_process): the backend is registered for the
life of the process.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

DEVICE_TYPE = "fakecuda"


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _FakeCudaModule:
    """What FSDP2, DeviceMesh and autocast ask of `torch.<device>`: streams and events that do nothing."""

    Stream, Event = _Stream, _Event

    def is_available(self):  # False: FakeTensorMode then never tries a real allocation on the device
        return False

    def is_initialized(self):
        return True

    def _is_in_bad_fork(self):
        return False

    def device_count(self):
        return 8

    def current_device(self):
        return 0

    def set_device(self, device):
        pass

    def current_stream(self, device=None):
        return _Stream()

    def stream(self, stream):
        return contextlib.nullcontext()

    def synchronize(self, device=None):
        pass

    def manual_seed_all(self, seed):
        pass

    def get_rng_state(self, device=None):
        return torch.zeros(8, dtype=torch.uint8)

    def set_rng_state(self, state, device=None):
        pass

    def get_amp_supported_dtype(self):
        return [torch.bfloat16, torch.float16]


def register_fake_device() -> torch.device:
    """Register the "fakecuda" backend in this process (once) and return its device 0."""
    if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=_FakeCudaModule())
    return torch.device(DEVICE_TYPE, 0)


class CheckedFakeMode(FakeTensorMode):
    """FakeTensorMode that fails a collective on a non-device tensor and records every collective."""

    def __init__(self, **kwargs):
        # real CPU tensors met inside (DeviceMesh's rank table) become fake CPU tensors
        super().__init__(allow_non_fake_inputs=True, **kwargs)
        self.collectives: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].is_floating_point() else 1
        if func.namespace in ("c10d", "_c10d_functional"):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            for tensor in tensors:
                if tensor.device.type != DEVICE_TYPE:
                    raise AssertionError(f"collective {func} on a {tensor.device} tensor: NCCL would refuse it")
            self.collectives.append((str(func), tuple(t.dtype for t in tensors)))
        return super().dispatch(func, types, args, kwargs)
