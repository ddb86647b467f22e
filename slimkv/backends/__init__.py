"""The kernel backends of attention, plug-ins the engine builder passes in
(:func:`slimkv.plugins.build_engine`): ``cpu`` (the fused C decode kernel and the one-call
decode step) and ``triton`` (CUDA). The core chooses among them once, when an engine is
built (:func:`slimkv.attention.layer.select_backend`), and runs on its own ``sdpa`` and
``reference`` backends where none can run."""

from slimkv.backends.cpu import CpuBackend
from slimkv.backends.triton import TritonBackend

KERNELS = {"cpu": CpuBackend, "triton": TritonBackend}
