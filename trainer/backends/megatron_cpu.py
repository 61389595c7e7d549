"""megatron-core on CPU: the shims that let its GPU-only code paths run on a CPU class (gloo).

megatron-core 0.19 makes a few CUDA calls unconditionally, even with `use_cpu_initialization` and a
gloo process group. A trainer on a CPU class (`trainer.accelerator: cpu`, device "cpu") installs these
shims once per process before building the model (`MegatronBackend` does it for device "cpu"); the
megatron CPU test tier (tests/trainer/megatron_cpu_checks.py) runs the same ones. Nothing else is
replaced:

- `CudaDevicesOnCpu` (a TorchFunctionMode): tensors megatron creates with `device="cuda"` /
  `torch.cuda.current_device()` (the schedule's token counter, the optimizer's found-inf and scale
  tensors, grad-norm buffers) are created on the CPU instead; `Tensor.cuda()` is the identity;
  `Tensor.type()` answers `torch.cuda.*Tensor` (the distributed optimizer dispatches on that string).
- `torch.cuda.current_device` returns the CPU device (no CUDA runtime to ask; also where autograd
  runs backward outside the mode above); `torch.cuda.current_stream` returns a stream object whose
  waits do nothing (the gradient buffer waits on CUDA-graph events, of which there are none; CPU work
  is synchronous); `torch.cuda.Stream()` makes such a stream (its recorded events are already
  complete) and `torch.cuda.stream(s)` is a null context: the MoE alltoall token dispatcher copies
  its token counts to the host on a side stream and waits on its event; its
  `maybe_move_tensor_to_cpu(..., as_numpy=True)` (token_dispatcher) returns the split sizes of its
  all-to-all as numpy for CPU tensors too (megatron converts only CUDA ones; torch's all_to_all_single
  takes no tensor of sizes).
- `CudaRNGStatesTracker.fork` is a null context: the CUDA RNG tracker forks CUDA RNG states around
  dropout; dropout is 0 in the backend, so no random number is drawn.
- megatron's `_get_cuda_rng_state` / `_set_cuda_rng_state` (tensor_parallel.random): activation
  recompute saves and restores the CUDA RNG state around each checkpointed layer; there is no CUDA
  generator, so the CPU generator's state is returned (megatron restores that one itself) and the
  setter does nothing; and `CheckpointFunction.backward` (which re-runs the layer's forward) runs
  under `CudaDevicesOnCpu`, which is not active where autograd runs backward.

Only for processes without GPUs: never install them where CUDA is meant to run.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_mode: CudaDevicesOnCpu | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaDevicesOnCpu(TorchFunctionMode):
    """CUDA placements -> CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class SynchronousEvent:
    """What a `SynchronousStream` records: everything before it has already happened."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class SynchronousStream:
    """What `torch.cuda.current_stream()` returns, and `torch.cuda.Stream()` makes, under the shims:
    CPU work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> SynchronousEvent:
        return SynchronousEvent()

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def install_cpu_shims() -> CudaDevicesOnCpu:
    """Install the shims in this process (idempotent); returns the active mode."""
    global _mode
    with _lock:
        if _mode is not None:
            return _mode
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        # torch types current_device() as an index; megatron only places tensors with it
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment, return-value]
        torch.cuda.current_stream = lambda *a, **k: SynchronousStream()  # type: ignore[assignment]
        # the MoE alltoall token dispatcher copies its token counts to the host on a side stream
        torch.cuda.Stream = SynchronousStream  # type: ignore[assignment, misc]
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
        # ... as numpy split sizes for its all-to-all; megatron converts only CUDA tensors
        from megatron.core.transformer.moe import token_dispatcher

        host_copy = token_dispatcher.maybe_move_tensor_to_cpu

        def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
            if as_numpy and isinstance(tensor, torch.Tensor) and not tensor.is_cuda:
                return tensor.numpy()
            return host_copy(tensor, as_numpy=as_numpy, record_stream=record_stream)

        token_dispatcher.maybe_move_tensor_to_cpu = to_host
        CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
        # activation recompute (CheckpointFunction) saves and restores the CUDA RNG state around each
        # layer; there is none: the CPU generator's state stands in (restored by megatron itself too)
        from megatron.core.tensor_parallel import random as megatron_random

        megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        megatron_random._set_cuda_rng_state = lambda *a, **k: None
        # ... and re-runs the layer's forward inside backward, where the mode above is not active
        recompute_backward = megatron_random.CheckpointFunction.backward

        def backward_in_mode(ctx: Any, *grads: Any) -> Any:
            with CudaDevicesOnCpu():
                return recompute_backward(ctx, *grads)

        megatron_random.CheckpointFunction.backward = staticmethod(backward_in_mode)
        mode = CudaDevicesOnCpu()
        mode.__enter__()
        _mode = mode
        return mode


def installed() -> bool:
    return _mode is not None
