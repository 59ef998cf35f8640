"""GPU memory that can be handed back to the driver and taken again at the same addresses.

Why the engine needs it
-----------------------
A CUDA graph replays its kernels with the pointers they had at capture. The trainer frees the engine's KV
cache after every rollout (``release_engine_cache``: ~32 GB at the 7B GSM8K preset, memory the backward
pass needs), and a cache allocated again lands at new addresses, so every decode graph had to be captured
again: 8 captures of ~90 ms a rollout at 7B, 256 + 2048 tokens, 0.7 s of a ~9 s GRPO step on an H200
(dev/LOG.md section 104).

CUDA's virtual memory management separates an address range from the memory behind it. A
`RemappableBuffer` reserves a range once (``cuMemAddressReserve``) and maps physical memory into it
(``cuMemCreate`` + ``cuMemMap``); ``unmap()`` gives the physical memory back to the driver (PyTorch's
allocator can then use it for the backward pass) and keeps the range; ``map()`` puts fresh physical memory
behind the same addresses. Graphs that point into the range stay valid across the round trip; only the
contents are lost, and the engine zero-fills the cache after each ``map()``, as a new cache would be.
vLLM's "sleep mode" keeps its graphs across an RL trainer's step the same way.

The driver API is called through ``ctypes`` (no compiled extension); tensors view the range through the
``__cuda_array_interface__`` protocol, so PyTorch never owns (or frees) this memory. Where the driver
lacks the API (or the device does not support it), `supported` is False and the engine keeps its old path:
a cache from PyTorch's allocator, freed with the graphs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_SUCCESS, _OUT_OF_MEMORY = 0, 2
_ATTRIBUTE_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ALLOCATION_PINNED, _LOCATION_DEVICE, _ACCESS_READ_WRITE = 1, 1, 3
_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    """A CUDA driver call failed; ``code`` is its CUresult."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda with the prototypes used here, or None where it cannot be loaded."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, size, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
    prototypes = {
        "cuDeviceGet": (ptr(ctypes.c_int), ctypes.c_int),
        "cuDeviceGetAttribute": (ptr(ctypes.c_int), ctypes.c_int, ctypes.c_int),
        "cuMemGetAllocationGranularity": (ptr(size), ptr(_AllocationProp), ctypes.c_int),
        "cuMemAddressReserve": (ptr(u64), size, size, u64, ctypes.c_ulonglong),
        "cuMemAddressFree": (u64, size),
        "cuMemCreate": (ptr(u64), size, ptr(_AllocationProp), ctypes.c_ulonglong),
        "cuMemRelease": (u64,),
        "cuMemMap": (u64, size, size, u64, ctypes.c_ulonglong),
        "cuMemUnmap": (u64, size),
        "cuMemSetAccess": (u64, size, ptr(_AccessDesc), size),
        "cuGetErrorName": (ctypes.c_int, ptr(ctypes.c_char_p)),
    }
    try:
        for name, args in prototypes.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(args), ctypes.c_int
    except AttributeError:  # a driver older than the API (CUDA 10.2)
        return None
    return lib


def _check(call: str, code: int) -> None:
    if code != _SUCCESS:
        text = ctypes.c_char_p()
        _driver().cuGetErrorName(code, ctypes.byref(text))
        raise DriverError(call, code, (text.value or b"?").decode())


def _device_prop(index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type, prop.location.type, prop.location.id = _ALLOCATION_PINNED, _LOCATION_DEVICE, index
    return prop


# Memory of every RemappableBuffer in this process that is mapped now, and the most since `reset_peak_mapped`:
# PyTorch's allocator never sees it, so its peak statistics need these added (bench/rollout.py, train/grpo.py).
_MAPPED = {"now": 0, "peak": 0}


def mapped_bytes() -> int:
    return _MAPPED["now"]


def peak_mapped_bytes() -> int:
    return _MAPPED["peak"]


def reset_peak_mapped() -> None:
    _MAPPED["peak"] = _MAPPED["now"]


def supported(device: torch.device) -> bool:
    """True where a `RemappableBuffer` can live on ``device`` (a CUDA device whose driver has the API)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    lib = _driver()
    if lib is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle, flag = ctypes.c_int(), ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(handle), index) != _SUCCESS:
        return False
    if lib.cuDeviceGetAttribute(ctypes.byref(flag), _ATTRIBUTE_VMM_SUPPORTED, handle) != _SUCCESS:
        return False
    return bool(flag.value)


class _Span:
    """What ``torch.as_tensor`` reads to view a buffer's bytes; the tensor keeps it, and it keeps the buffer
    (so the range is not freed while a view of it exists)."""

    def __init__(self, owner: "RemappableBuffer"):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (owner.nbytes,), "typestr": "|u1", "data": (owner.address, False),
                                         "strides": None, "version": 3}


class RemappableBuffer:
    """``nbytes`` (rounded up to the driver's granularity) of device memory at an address that survives
    `unmap` / `map`. ``view()`` is a uint8 tensor of the whole range, usable only while the buffer is mapped.
    A driver that refuses the API raises `DriverError`; no room (now or at a later `map_or_raise`),
    ``torch.OutOfMemoryError(no_room)``."""

    def __init__(self, nbytes: int, device: torch.device, no_room: str = "no room for a remappable buffer"):
        if not supported(device):
            raise RuntimeError(f"{device}: CUDA virtual memory management is not available here")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        lib, self._prop = _driver(), _device_prop(self.device.index)
        granularity = ctypes.c_size_t()
        _check("cuMemGetAllocationGranularity", lib.cuMemGetAllocationGranularity(
            ctypes.byref(granularity), ctypes.byref(self._prop), _GRANULARITY_RECOMMENDED))
        step = max(int(granularity.value), 1)
        self.nbytes = -(-int(nbytes) // step) * step
        address = ctypes.c_uint64()
        _check("cuMemAddressReserve", lib.cuMemAddressReserve(ctypes.byref(address), self.nbytes, step, 0, 0))
        self.address, self._handle, self.no_room = int(address.value), None, no_room
        try:
            map_or_raise(self)  # (torch.OutOfMemoryError(no_room) where even an emptied cache leaves no room)
        except BaseException:
            self.close()
            raise

    def view(self) -> torch.Tensor:
        """A uint8 tensor over the whole range (no copy, not owned by PyTorch's allocator)."""
        if self.address is None:
            raise RuntimeError("the buffer was closed")
        with torch.cuda.device(self.device):
            return torch.as_tensor(_Span(self), device=self.device)

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Put fresh physical memory behind the range (contents undefined). Raises `DriverError` with
        ``code`` 2 (out of memory) when the device has no room; the range stays reserved."""
        if self.mapped:
            return
        lib, handle = _driver(), ctypes.c_uint64()
        _check("cuMemCreate", lib.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(self._prop), 0))
        try:
            _check("cuMemMap", lib.cuMemMap(self.address, self.nbytes, 0, handle.value, 0))
            access = _AccessDesc()
            access.location.type, access.location.id, access.flags = (_LOCATION_DEVICE, self.device.index,
                                                                      _ACCESS_READ_WRITE)
            _check("cuMemSetAccess", lib.cuMemSetAccess(self.address, self.nbytes, ctypes.byref(access), 1))
        except BaseException:
            lib.cuMemUnmap(self.address, self.nbytes)
            lib.cuMemRelease(handle.value)
            raise
        self._handle = handle.value
        _MAPPED["now"] += self.nbytes
        _MAPPED["peak"] = max(_MAPPED["peak"], _MAPPED["now"])

    def unmap(self) -> None:
        """Give the physical memory back to the driver, after the device's pending work; keep the range."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)  # no kernel may still read or write it
        lib = _driver()
        _check("cuMemUnmap", lib.cuMemUnmap(self.address, self.nbytes))
        _check("cuMemRelease", lib.cuMemRelease(self._handle))
        self._handle = None
        _MAPPED["now"] -= self.nbytes

    def close(self) -> None:
        """Unmap and free the range; the buffer and every view of it are unusable afterwards."""
        if getattr(self, "address", None) is None:
            return
        self.unmap()
        _check("cuMemAddressFree", _driver().cuMemAddressFree(self.address, self.nbytes))
        self.address = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


def map_or_raise(buffer: RemappableBuffer) -> bool:
    """Map ``buffer`` if it is not; where the device has no room, PyTorch's cached blocks (a trainer's freed
    activations) go back to the driver and it tries once more, then raises ``torch.OutOfMemoryError`` with the
    buffer's ``no_room`` message. True when it mapped (the contents are then undefined)."""
    if buffer.mapped:
        return False
    for attempt in (0, 1):
        try:
            buffer.map()
            return True
        except DriverError as error:
            if error.code != _OUT_OF_MEMORY:
                raise
            if attempt:
                raise torch.OutOfMemoryError(buffer.no_room) from error
            torch.cuda.empty_cache()


class Remappable:
    """What the engine asks of an object whose tensors may live in a `RemappableBuffer` (``_buffer``; None: in
    PyTorch's allocator, freed only by dropping the object)."""

    _buffer: RemappableBuffer | None = None

    @property
    def remappable(self) -> bool:
        return self._buffer is not None

    @property
    def resident(self) -> bool:
        """True while the memory is allocated (False between `unmap` and the next map)."""
        return self._buffer is None or self._buffer.mapped

    def unmap(self) -> None:
        """Give the memory back to the driver; the addresses stay reserved for the next map."""
        self._buffer.unmap()
