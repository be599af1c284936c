"""A fake accelerator for CPU-only CI: every tensor lives on device "fakecuda", none holds data.

Why not the name "cuda": a CPU-only torch build cannot run autograd on cuda-typed tensors (the
engine asks the CUDA hooks for streams), so the fake device is torch's PrivateUse1 backend renamed
"fakecuda", with a no-op stream/event module, under FakeTensorMode (shapes, dtypes and devices are
computed; no memory is allocated). It catches what a GPU would refuse:
  * a CPU tensor mixed into device math (FakeTensorMode raises FakeTensorDeviceMismatchError;
    0-dim CPU scalars are allowed, as on CUDA),
  * a collective on a host tensor (NCCL/XCCL take device tensors only): `CheckedFakeMode` fails it,
  * and it records every collective's op and tensor dtypes for the test to inspect.
A host read (`.item()`, `.tolist()`) has no data to read: see CheckedFakeMode._host_value.
bf16 autocast works on the fake device as on CUDA for the matmul-like ops (see _LOWER_PRECISION_OPS).
Run each test body through `in_fresh_process`: the backend stays registered for the life of the
process, and it must be registered before autograd first runs a backward there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import _disable_current_modes

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


# bf16/fp16 autocast on the fake device casts what CUDA's autocast casts to lower precision
_LOWER_PRECISION_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm",
                        "scaled_dot_product_attention")
_ACTIVE_MODES: list[FakeTensorMode] = []  # the CheckedFakeMode in use (a few C++ paths bypass it)
_LIBRARIES: list[torch.library.Library] = []  # kept alive: dropping a Library drops its kernels


def _lower_precision(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(DEVICE_TYPE)

        def cast(t):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == DEVICE_TYPE else t

        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    with _ACTIVE_MODES[-1]:  # a factory reached the backend itself (tensor indexing does): make it fake
        return torch.empty(size, dtype=dtype, device=device)


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    with _ACTIVE_MODES[-1]:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)


def register_fake_device() -> torch.device:
    """Register the "fakecuda" backend in this process (once) and return its device 0."""
    if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=_FakeCudaModule())
        factories = torch.library.Library("aten", "IMPL")
        factories.impl("empty.memory_format", _empty, "PrivateUse1")
        factories.impl("empty_strided", _empty_strided, "PrivateUse1")
        autocast = torch.library.Library("_", "IMPL")
        autocast.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
        autocast_ops = torch.library.Library("aten", "IMPL")
        for name in _LOWER_PRECISION_OPS:
            autocast_ops.impl(name, _lower_precision(getattr(torch.ops.aten, name).default), "AutocastPrivateUse1")
        _LIBRARIES.extend([factories, autocast, autocast_ops])
    return torch.device(DEVICE_TYPE, 0)


class CheckedFakeMode(FakeTensorMode):
    """FakeTensorMode that fails a collective on a non-device tensor and records every collective."""

    def __init__(self, count_value: int = 0, **kwargs):
        # real CPU tensors met inside (DeviceMesh's rank table) become fake CPU tensors
        super().__init__(allow_non_fake_inputs=True, **kwargs)
        self.count_value = count_value
        self.collectives: list[tuple[str, tuple[torch.dtype, ...]]] = []
        self.matmul_dtypes: set[torch.dtype] = set()  # dtypes the matmuls ran in (autocast check)

    def _host_value(self, tensor: torch.Tensor):
        """What `.item()` / `.tolist()` read from a tensor that holds no data.

        Floats (a loss, a norm): 1.0. int64 on the device (expert counts: MoE routing, EP splits):
        count_value, i.e. every expert gets the same number of rows; it must be T*k/E (tokens x
        top_k / experts) so that counts add up to the rows. Other integers (the pipeline's start-up
        vote, int32; host-side index arithmetic on fake host tensors, which is rank 0's: 0): 0. A
        vote of 0 asks for shape inference (answered by fake_pipeline_peers).
        """
        if tensor.is_floating_point():
            return 1.0
        if tensor.dtype == torch.bool:
            return False
        if tensor.dtype == torch.int64 and tensor.device.type == DEVICE_TYPE:
            return self.count_value
        return 0

    def __enter__(self):
        _ACTIVE_MODES.append(self)
        return super().__enter__()

    def __exit__(self, *exc_info):
        _ACTIVE_MODES.remove(self)
        return super().__exit__(*exc_info)

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._host_value(args[0])
        if func.namespace in ("c10d", "_c10d_functional"):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            for tensor in tensors:
                if tensor.device.type != DEVICE_TYPE:
                    raise AssertionError(f"collective {func} on a {tensor.device} tensor: NCCL would refuse it")
            self.collectives.append((str(func), tuple(t.dtype for t in tensors)))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = torch.device(kwargs.get("device") or "cpu").type == "cpu"
        if (tensors and not any(isinstance(t, FakeTensor) for t in tensors)) or (not tensors and on_host):
            # host-only work (DeviceMesh's rank tables, index arithmetic, the initial weights, a host
            # buffer made here) is computed for real: its values stay exact. A real host tensor that
            # meets a device tensor becomes a fake host tensor, so a CPU/device mix-up still fails.
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.matmul_dtypes.add(tensors[-1].dtype)
        return super().dispatch(func, types, args, kwargs)


@contextlib.contextmanager
def swappable_fake_parameters(mode: FakeTensorMode):
    """Let `module.to_empty` move plain fake parameters (a layout without FSDP or tp: pp only) to the device.

    torch swaps a FakeTensor parameter for the new one in place (torch.utils.swap_tensors), which refuses
    tensors anything weakly references, and the mode's converter memo weakly references the fake tensors it
    made, the new one included: forget them just before each swap (a memo only: nothing is converted again).
    Real devices take the `.data =` path instead.
    """
    import torch.utils

    original = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        return original(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def fake_pipeline_peers():
    """Answer the pipeline stages' start-up metadata exchange as the peer stages would.

    torch.distributed.pipelining infers the activation shapes at the first step by sending metadata
    objects between neighbouring stages; a fake process group delivers nothing. Here a stage's
    backward metadata from the next stage is the gradient of its own outputs (same metas), and
    forward metadata from the previous stage is what this rank's own earlier stage sent on (every
    stage boundary carries the same hidden-state shape). So this process can play rank 0 (the first
    stage; with interleaving, a middle one too).
    """
    from unittest import mock

    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta
    from torch.distributed.pipelining.stage import PipelineStage

    sent_forward: list[_StageForwardMeta] = []

    def send_meta(stage, meta, dst_stage):
        if isinstance(meta, _StageForwardMeta):
            sent_forward.append(meta)

    def recv_meta(stage, src_stage):
        if src_stage > stage.stage_index:
            return _StageBackwardMeta(backward_metas=tuple(stage._stage_meta.outputs))
        if not sent_forward:
            raise AssertionError("fake_pipeline_peers can only play a rank holding the first stage")
        return sent_forward[-1]

    with mock.patch.object(PipelineStage, "_send_meta", send_meta), \
            mock.patch.object(PipelineStage, "_recv_meta", recv_meta):
        yield


def _run_test_body(connection, module_name: str, test_name: str, args, kwargs) -> None:
    import importlib
    import traceback

    torch.set_num_threads(1)
    try:
        test_fn = getattr(importlib.import_module(module_name), test_name).__wrapped__
        test_fn(*args, **kwargs)
        connection.send(("ok", None))
    except BaseException:
        connection.send(("error", traceback.format_exc()))


def in_fresh_process(test_fn):
    """Run a test's body in a child forked from a fresh interpreter (multiprocessing's forkserver).

    Not a fork of the pytest process: once autograd has run a backward there, its engine has fixed
    its per-device queues, and a child that registers the fake device then fails in backward. The
    forkserver never runs a backward, so its children start clean (and fast: torch is preloaded).
    """
    import functools
    import multiprocessing

    @functools.wraps(test_fn)
    def wrapper(*args, **kwargs):
        context = multiprocessing.get_context("forkserver")
        # everything a test body imports, imported once in the server rather than once per child (~2 s each)
        context.set_forkserver_preload(["torch", "torch.distributed", "optimus.parallel.parallelize",
                                        "optimus.train.step", "optimus.train.state", "optimus.optim.build",
                                        "torch.testing._internal.distributed.fake_pg", "tests.helpers.parity",
                                        test_fn.__module__])
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=_run_test_body, args=(sender, test_fn.__module__, test_fn.__name__, args, kwargs))
        child.start()
        sender.close()
        outcome = receiver.recv() if receiver.poll(300) else ("error", "the fake-device test process hung or died")
        child.join(10)
        if child.is_alive():
            child.kill()
        if outcome[0] != "ok":
            pytest.fail(f"fake-device test failed:\n{outcome[1]}", pytrace=False)

    return wrapper
