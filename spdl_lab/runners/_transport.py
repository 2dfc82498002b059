"""Moving outputs from the child to the parent through shared memory.

The child pickles an output with a ``persistent_id`` hook that takes numpy
arrays and CPU torch tensors out of the stream: their bytes are copied once
into a reusable shared-memory slot, and the pickle keeps only a descriptor.
The parent unpickles with the matching hook, copying each array once out of
the slot into memory it owns, then hands the slot back. Everything else
(small Python objects, the structure of lists, tuples and dicts) is pickled.
"""

from __future__ import annotations

import io
import pickle
import queue
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib.format import descr_to_dtype, dtype_to_descr

from ._shm import ShmFile

__all__ = ["Encoded", "SlotWriter", "SlotReader", "encode", "write_arrays", "decode"]

_ALIGN = 64
#: Slots grow to fit the largest output seen, with headroom so that batches
#: of slightly varying size do not make a slot be re-created every time.
_MIN_SLOT = 1 << 20
_GROWTH = 1.25


class Encoded:
    """An output ready to send: pickle bytes plus the arrays to copy into a slot."""

    __slots__ = ("meta", "arrays", "nbytes")

    def __init__(self, meta: bytes, arrays: list[tuple[int, Any]], nbytes: int) -> None:
        self.meta = meta
        self.arrays = arrays
        self.nbytes = nbytes


class _Encoder(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[tuple[int, Any]] = []
        self.nbytes = 0

    def _place(self, obj: Any, nbytes: int) -> int:
        offset = -(-self.nbytes // _ALIGN) * _ALIGN
        self.arrays.append((offset, obj))
        self.nbytes = offset + nbytes
        return offset

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            return ("nd", self._place(obj, obj.nbytes), dtype_to_descr(obj.dtype), obj.shape)
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and _plain_cpu_tensor(obj, torch):
            nbytes = obj.numel() * obj.element_size()
            return ("pt", self._place(obj, nbytes), str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return None


def _plain_cpu_tensor(t: Any, torch: Any) -> bool:
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def encode(obj: Any) -> Encoded:
    buffer = io.BytesIO()
    encoder = _Encoder(buffer)
    encoder.dump(obj)
    return Encoded(buffer.getvalue(), encoder.arrays, encoder.nbytes)


def write_arrays(encoded: Encoded, shm: ShmFile) -> None:
    """Copy each array's bytes into the slot at its offset (one copy, strides honoured)."""
    for offset, obj in encoded.arrays:
        if isinstance(obj, np.ndarray):
            if obj.size:
                dest = np.frombuffer(shm.map, dtype=obj.dtype, count=obj.size, offset=offset)
                np.copyto(dest.reshape(obj.shape), obj, casting="no")
                del dest
        else:
            torch = sys.modules["torch"]
            if obj.numel():
                dest = torch.frombuffer(shm.map, dtype=obj.dtype, count=obj.numel(), offset=offset)
                dest.view(obj.shape).copy_(obj)
                del dest


def decode(meta: bytes, shm: ShmFile | None) -> Any:
    return _Decoder(io.BytesIO(meta), shm).load()


class _Decoder(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shm: ShmFile | None) -> None:
        super().__init__(file)
        self._shm = shm

    def persistent_load(self, pid: Any) -> Any:
        kind, offset, dtype, shape = pid
        count = int(np.prod(shape, dtype=np.int64))
        if kind == "nd":
            dt = descr_to_dtype(dtype)
            if count == 0:
                return np.empty(shape, dtype=dt)
            view = np.frombuffer(self._shm.map, dtype=dt, count=count, offset=offset)  # type: ignore[union-attr]
            out = view.reshape(shape).copy()
            del view
            return out
        import torch

        tdtype = getattr(torch, dtype)
        if count == 0:
            return torch.empty(shape, dtype=tdtype)
        view = torch.frombuffer(self._shm.map, dtype=tdtype, count=count, offset=offset)  # type: ignore[union-attr]
        out = view.view(shape).clone()
        del view
        return out


class SlotWriter:
    """Child side: ``count`` reusable segments; a slot is busy until the parent releases it."""

    def __init__(self, prefix: str, count: int) -> None:
        self._prefix = prefix
        self._slots: list[ShmFile | None] = [None] * count
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(count):
            self._free.put(i)
        self._made = 0

    def acquire(self, nbytes: int, stopping: Callable[[], bool]) -> tuple[int, ShmFile]:
        """A free slot of at least ``nbytes``; waits (0.1 s polls) unless ``stopping()``."""
        while True:
            try:
                slot_id = self._free.get(timeout=0.1)
                break
            except queue.Empty:
                if stopping():
                    raise InterruptedError("stopping") from None
        shm = self._slots[slot_id]
        if shm is None or shm.size < nbytes:
            if shm is not None:
                shm.close()
                shm.unlink()
                self._slots[slot_id] = None
            self._made += 1
            size = max(_MIN_SLOT, int(nbytes * _GROWTH))
            try:
                shm = ShmFile(
                    f"{self._prefix}slot{slot_id}_{self._made}", size, create=True,
                    purpose="the transfer buffer of an output",
                )
            except BaseException:
                self._free.put(slot_id)
                raise
            self._slots[slot_id] = shm
        return slot_id, shm

    def release(self, slot_id: int) -> None:
        self._free.put(slot_id)

    def close(self) -> None:
        for shm in self._slots:
            if shm is not None:
                shm.close()
                shm.unlink()
        self._slots = [None] * len(self._slots)


class SlotReader:
    """Parent side: maps each slot by name, re-mapping when the child replaced it."""

    def __init__(self) -> None:
        self._maps: dict[int, ShmFile] = {}

    def get(self, slot_id: int, name: str, size: int) -> ShmFile:
        shm = self._maps.get(slot_id)
        if shm is None or shm.name != name:
            if shm is not None:
                shm.close()
            shm = self._maps[slot_id] = ShmFile(name, size, create=False)
        return shm

    def close(self) -> None:
        for shm in self._maps.values():
            shm.close()
        self._maps.clear()
