"""PyCudaBackend: the CUDA kernels of worker/kernels/*.cu compiled at run time by PyCUDA's
SourceModule and launched on PyTorch CUDA tensors (pointers from tensor.data_ptr()).

* PyCUDA is imported inside __init__ only: machines without CUDA never import it.
* Context: PyTorch uses the device's primary context, so PyCUDA must too: torch's CUDA is
  initialised first, then that primary context is retained and pushed on PyCUDA's stack for the
  construction only (module load, stream), and popped. So a backend built on one thread works on
  any other (pycuda.autoprimaryctx would leave it pushed on the importing thread alone); a thread's
  first launch binds the primary context there through the runtime (one synchronize), in case
  that thread has not run torch CUDA work yet. Never `pycuda.autoinit` (a second context).
* Streams: a kernel must run in order with the torch work around it. When torch's current stream is
  the legacy default stream (handle 0, the usual case) we launch on the null stream, which is the
  same stream. Otherwise the launch goes to a PyCUDA stream owned by the backend, fenced both ways
  with events: it waits for an event recorded on torch's current stream, and torch's current stream
  then waits for it (torch.cuda.ExternalStream wraps the PyCUDA stream's handle). So the result is
  ordered on torch's current stream either way, and the caching allocator's stream reuse is safe.
* The host-side launch logic (checks, grid/block, split-KV, workspaces) is launch.KernelBackendBase,
  shared with the CPU emulation that CI tests.
"""
from __future__ import annotations

import os
import threading

import torch

from worker.kernels import source
from worker.kernels.launch import KernelBackendBase, Launch


class PyCudaBackend(KernelBackendBase):
    name = "pycuda"

    def __init__(self, device: str | torch.device | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the pycuda attention backend needs a CUDA device (torch.cuda is "
                               "not available); use the 'torch' backend on this machine")
        dev = torch.device(device if device is not None else "cuda")
        if dev.type != "cuda":
            raise ValueError(f"the pycuda attention backend runs on CUDA devices, not {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        torch.cuda.init()
        with torch.cuda.device(dev):
            torch.empty(1, device=dev)            # the primary context exists and is current
        import pycuda.driver as cuda
        from pycuda.compiler import SourceModule

        cuda.init()
        self._ctx = cuda.Device(dev.index).retain_primary_context()   # the one torch uses
        self._ctx.push()
        try:
            props = torch.cuda.get_device_properties(dev)
            self.num_sms = props.multi_processor_count
            self.arch = f"sm_{props.major}{props.minor}"
            self._module = SourceModule(source.module_source(), no_extern_c=True,
                                        options=source.pycuda_options(), arch=self.arch,
                                        cache_dir=os.environ.get("PYCUDA_CACHE_DIR") or None)
            self._calls = {}                    # name -> (prepared function, signature)
            for name, sig in source.kernel_signatures().items():
                fn = self._module.get_function(name)
                fn.prepare(sig)
                self._calls[name] = (fn, sig)
            self._stream = cuda.Stream()
        finally:
            self._ctx.pop()
        self._ext = torch.cuda.ExternalStream(self._stream.handle, device=dev)
        self._threads = threading.local()       # .bound: this thread's first launch is done
        self.last_num_splits = None

    def _launch(self, launch: Launch) -> None:
        fn, sig = self._calls[launch.kernel]
        if len(sig) != len(launch.args):
            raise TypeError(f"{launch.kernel}: {len(launch.args)} arguments for signature {sig}")
        args = []
        for letter, a in zip(sig, launch.args):
            if letter == "P":
                if not isinstance(a, torch.Tensor) or a.device != self.device:
                    raise TypeError(f"{launch.kernel}: expected a tensor on {self.device}")
                args.append(a.data_ptr())
            elif letter == "i":
                args.append(int(a))
            else:
                args.append(float(a))
        if torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)
        if not getattr(self._threads, "bound", False):
            torch.cuda.synchronize(self.device)    # the runtime makes the primary context current
            self._threads.bound = True
        current = torch.cuda.current_stream(self.device)
        if current.cuda_stream == 0:
            fn.prepared_call(launch.grid, launch.block, *args)
        else:
            ready = torch.cuda.Event()
            ready.record(current)
            self._ext.wait_event(ready)
            fn.prepared_async_call(launch.grid, launch.block, self._stream, *args)
            current.wait_stream(self._ext)
