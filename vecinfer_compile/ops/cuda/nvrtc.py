"""Run-time compilation and launch of CUDA C++ kernels: NVRTC and the CUDA driver through ctypes.

Why this route: the only compiler a PyTorch user with a CUDA GPU is sure to have is NVRTC, which
torch's CUDA wheels depend on (package ``nvidia-cuda-nvrtc``), and the driver library
``libcuda.so.1`` comes with every NVIDIA driver. Both have stable C ABIs, so a few ctypes
bindings compile and launch a kernel with no toolkit, no nvcc, no headers and no new dependency,
identically on torch 2.11 and 2.13. The alternatives were weighed: ``torch.cuda._compile_kernel``
is private and looks for CUDA headers through CUDA_HOME or /usr/local/cuda (it raises without
them); ``cuda.core`` is NVIDIA's public API for the same but is not a dependency of torch.

Sources must be header-free (16-bit floats as ``unsigned short``, PTX for conversions and tensor
cores). :func:`compile_module` compiles to a cubin for the device's own architecture (falling back
to PTX when this NVRTC does not know the architecture), :class:`Kernel` launches on torch's current
stream (so CUDA graphs capture it) with arguments passed by value.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

HALF_BITS = Path(__file__).with_name("half_bits.cuh")


def with_half_bits(source: str) -> str:
    """``source`` after ``half_bits.cuh``: the window dtype's conversions, for kernels that read or
    write 16-bit floats."""
    return HALF_BITS.read_text() + source


class CudaBuildError(RuntimeError):
    """NVRTC or the driver could not be found, or the source did not compile or load."""


def device_index(device: torch.device) -> int:
    """The index of the CUDA device ``device`` names (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def unfit_device_reason(
    t: torch.Tensor, dtypes, dtype_reason: str, kernel: str, min_arch: int, subject: str = "the inputs are"
) -> str | None:
    """Why ``kernel`` (its name in the message, e.g. ``"the CUDA kernel"``) cannot run on ``t``
    (None if it can), checked in this order: ``t`` (``subject`` in the message) is not on a CUDA
    device; its dtype is not in ``dtypes`` (``dtype_reason``, formatted with ``dtype``); the GPU is
    older than ``sm_<min_arch>``. Reads no data, so it works on fake tensors."""
    if t.device.type != "cuda":
        return f"{subject} on {t.device.type}, not CUDA"
    if t.dtype not in dtypes:
        return dtype_reason.format(dtype=t.dtype)
    major, minor = torch.cuda.get_device_capability(t.device)
    if major * 10 + minor < min_arch:
        return f"the GPU is sm_{major}{minor}; {kernel} needs sm_{min_arch} or newer"
    return None


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (launch shapes are sized from it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _nvrtc_candidates() -> list[str]:
    """Library names and paths to try, most specific first: the soname of torch's CUDA major
    version (already loaded with torch, or on the loader path), then the ``nvidia`` pip wheels'
    lib folders (``nvidia/cu13/lib``, ``nvidia/cuda_nvrtc/lib``)."""
    names = []
    major = (torch.version.cuda or "").split(".")[0]
    for m in ([major] if major else []) + ["13", "12"]:
        if f"libnvrtc.so.{m}" not in names:
            names.append(f"libnvrtc.so.{m}")
    for root in sys.path:
        for pattern in ("nvidia/cu*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
            names.extend(
                p
                for p in sorted(glob.glob(os.path.join(root, pattern)), reverse=True)
                if "builtins" not in p and "alt" not in os.path.basename(p)
            )
    return names


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (a :class:`CudaBuildError` naming the fix if there is none)."""
    tried = _nvrtc_candidates()
    for name in tried:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise CudaBuildError(
        "NVRTC (libnvrtc) was not found; it comes with torch's CUDA wheels as the package "
        "nvidia-cuda-nvrtc: `pip install nvidia-cuda-nvrtc` (tried " + ", ".join(tried[:4]) + ")"
    )


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaBuildError(f"the CUDA driver library libcuda.so.1 could not be loaded: {exc}") from None
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check_nvrtc(status: int, what: str, log: str = "") -> None:
    if status != 0:
        msg = nvrtc().nvrtcGetErrorString(status).decode()
        raise CudaBuildError(f"{what} failed: {msg}" + (f"\n{log}" if log else ""))


def _check_cu(status: int, what: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(status, ctypes.byref(text))
        raise CudaBuildError(f"{what} failed: CUDA driver error {status} ({(text.value or b'?').decode()})")


def supported_archs() -> list[int]:
    """Compute capabilities this NVRTC can target (e.g. ``[75, 80, ..., 120]``)."""
    lib = nvrtc()
    n = ctypes.c_int()
    _check_nvrtc(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * n.value)()
    _check_nvrtc(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return list(archs)


def compile_source(source: str, name: str, arch: int, options: list[str]) -> tuple[bytes, bool]:
    """Compile ``source`` for ``sm_{arch}`` -> (image, is_cubin). A cubin when this NVRTC knows the
    architecture, else PTX for the newest one it knows (the driver finishes it at load)."""
    lib = nvrtc()
    known = supported_archs()
    cubin = arch in known
    target = arch if cubin else max(a for a in known if a <= arch) if any(a <= arch for a in known) else None
    if target is None:
        raise CudaBuildError(f"this NVRTC targets compute capabilities {known}, none at or below sm_{arch}")
    prog = ctypes.c_void_p()
    _check_nvrtc(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={'sm' if cubin else 'compute'}_{target}", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
        log_buf = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(prog, log_buf)
        _check_nvrtc(status, f"compiling {name} with NVRTC ({' '.join(opts)})", log_buf.value.decode(errors="replace"))
        size = ctypes.c_size_t()
        get_size, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        _check_nvrtc(get_size(prog, ctypes.byref(size)), "nvrtcGet*Size")
        image = ctypes.create_string_buffer(size.value)
        _check_nvrtc(get(prog, image), "nvrtcGet*")
        return image.raw, cubin
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class _LaunchAttributeValue(ctypes.Union):
    """``CUlaunchAttributeValue``: a 64-byte union; only ``clusterDim`` is used here."""

    _fields_ = [("pad", ctypes.c_char * 64), ("cluster_dim", ctypes.c_uint * 3), ("align", ctypes.c_uint64)]


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, the value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx`` (CUDA 12+)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


def _cluster_config(
    grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream: int, cluster: tuple[int, int, int]
) -> tuple[_LaunchConfig, _LaunchAttribute]:
    """A launch configuration with a cluster-dimension attribute (returned too: it must outlive the call)."""
    attr = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attr.value.cluster_dim[:] = list(cluster)
    config = _LaunchConfig(
        (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, stream, ctypes.pointer(attr), 1
    )
    return config, attr


@dataclass
class Kernel:
    """A loaded kernel function. ``launch`` takes tensors (passed as device pointers), Python ints
    (``int``) and floats (``float``), in the kernel's parameter order."""

    name: str
    handle: ctypes.c_void_p
    module: ctypes.c_void_p
    dynamic_smem: int = 0

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        _check_cu(driver().cuFuncGetAttribute(ctypes.byref(value), attr, self.handle), "cuFuncGetAttribute")
        return value.value

    @property
    def registers(self) -> int:
        return self.attribute(CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def local_bytes(self) -> int:
        return self.attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)

    def set_dynamic_smem(self, nbytes: int) -> None:
        """Launch with ``nbytes`` of dynamic shared memory, opting in above the default 48 KiB a CTA
        (static and dynamic together)."""
        if nbytes + self.attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) > 48 * 1024:
            _check_cu(
                driver().cuFuncSetAttribute(self.handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                f"raising {self.name}'s dynamic shared memory to {nbytes} bytes",
            )
        self.dynamic_smem = nbytes

    def max_active_clusters(self, cluster: tuple[int, int, int], block: tuple[int, int, int]) -> int:
        """Clusters of ``cluster`` CTAs (``block`` threads, this kernel's shared memory) that the
        device holds at once (``cuOccupancyMaxActiveClusters``; 0 if it cannot place one)."""
        config, _attr = _cluster_config(cluster, block, self.dynamic_smem, 0, cluster)
        n = ctypes.c_int()
        _check_cu(
            driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), self.handle, ctypes.byref(config)),
            f"cuOccupancyMaxActiveClusters({self.name}, cluster {cluster})",
        )
        return n.value

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list,
        cluster: tuple[int, int, int] | None = None,
    ) -> None:
        """Launch on torch's current stream; with ``cluster``, as thread-block clusters of that shape
        (``cuLaunchKernelEx``; sm_90, each grid dimension a multiple of the cluster's)."""
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                values.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, bool) or isinstance(a, int):
                values.append(ctypes.c_int(int(a)))
            elif isinstance(a, float):
                values.append(ctypes.c_float(a))
            elif a is None:
                values.append(ctypes.c_void_p(0))
            else:
                raise TypeError(f"cannot pass {type(a).__name__} to a CUDA kernel")
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        stream = torch.cuda.current_stream().cuda_stream
        if cluster is None:
            _check_cu(
                driver().cuLaunchKernel(
                    self.handle, *grid, *block, self.dynamic_smem, ctypes.c_void_p(stream), params, None
                ),
                f"launching {self.name}",
            )
            return
        config, _attr = _cluster_config(grid, block, self.dynamic_smem, stream, cluster)
        _check_cu(
            driver().cuLaunchKernelEx(ctypes.byref(config), self.handle, params, None),
            f"launching {self.name} in clusters of {cluster}",
        )


def _ensure_context(device: torch.device) -> None:
    """Make torch's primary context of ``device`` current on this thread (module loads need it)."""
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # creates the primary context if torch has not yet
        ctx = ctypes.c_void_p()
        _check_cu(driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            _check_cu(driver().cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
            _check_cu(driver().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _check_cu(driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def load_kernels(image: bytes, names: list[str], device: torch.device) -> dict[str, Kernel]:
    """Load a cubin/PTX image into ``device``'s context and fetch the named functions."""
    _ensure_context(device)
    module = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check_cu(driver().cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)), "cuModuleLoadData")
        kernels = {}
        for name in names:
            fn = ctypes.c_void_p()
            _check_cu(
                driver().cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), f"cuModuleGetFunction({name})"
            )
            kernels[name] = Kernel(name, fn, module)
    return kernels


class _DeviceArray:
    """``__cuda_array_interface__`` of ``n`` elements (``typestr``, e.g. ``<i4``) of driver-allocated
    device memory, for :func:`torch.as_tensor`. torch keeps this object alive as long as the
    tensor's storage; with ``owned`` the memory is freed when both are gone."""

    def __init__(self, ptr: int, n: int, typestr: str, owned: bool):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (ptr, False), "version": 3}
        self._ptr, self._owned = ptr, owned

    def __del__(self):
        if self._owned:
            try:
                driver().cuMemFree_v2(ctypes.c_uint64(self._ptr))
            except Exception:  # interpreter shutdown: the driver may already be gone
                pass


def _driver_alloc(nbytes: int, device: torch.device) -> int:
    _ensure_context(device)
    ptr = ctypes.c_uint64()
    with torch.cuda.device(device):
        _check_cu(
            driver().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1))), f"allocating {nbytes} bytes"
        )
    return ptr.value


def device_zeros_int32(n: int, device: torch.device) -> torch.Tensor:
    """int32 ``[n]`` zeros in device memory allocated by the driver, outside torch's allocator, and
    never freed: for scratch that CUDA graphs keep using and no graph memory pool may reuse. Zeroed
    on torch's current stream (work launched after it on that stream sees the zeros)."""
    ptr = _driver_alloc(4 * n, device)
    with torch.cuda.device(device):
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        _check_cu(
            driver().cuMemsetD32Async(ctypes.c_uint64(ptr), ctypes.c_uint(0), ctypes.c_size_t(n), stream),
            "zeroing the allocation",
        )
    return torch.as_tensor(_DeviceArray(ptr, n, "<i4", owned=False), device=device)


def device_copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (a CUDA tensor) converted to 16-bit ``dtype`` (same shape, contiguous, 256-byte
    aligned) in memory allocated by the driver, outside torch's allocator, and freed with the
    returned tensor. For a constant kept across calls: an allocation from torch's allocator
    made while a CUDA-graph tree warms a graph up comes from that graph's private pool, and a live
    tensor there that the graph does not return fails its capture ("tensor(s) in the cudagraph
    pool not tracked as outputs"). Converted on torch's current stream."""
    if dtype.itemsize != 2:
        raise ValueError(f"device_copy makes 16-bit copies, not {dtype}")
    n = x.numel()
    holder = _DeviceArray(_driver_alloc(2 * n, x.device), n, "<i2", owned=True)
    out = torch.as_tensor(holder, device=x.device).view(dtype).view(x.shape)
    out.copy_(x)
    return out


def build_kernel(source: str, name: str, device: torch.device, options: list[str]) -> Kernel:
    """Compile ``source`` for ``device``'s architecture with ``options`` and load its kernel ``name``."""
    major, minor = torch.cuda.get_device_capability(device)
    image, _ = compile_source(source, name, major * 10 + minor, options)
    return load_kernels(image, [name], device)[name]
