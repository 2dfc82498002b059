"""Work to another process (cloudpickle, or an error naming the culprit) and outputs back: arrays
and CPU tensors copied once into a reusable shared-memory slot, lent to the parent as views of it,
or copied if the child would lack one."""

from __future__ import annotations

import contextlib
import ctypes
import io
import pickle
import queue
import sys
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import cloudpickle
import numpy as np
from numpy.lib.format import descr_to_dtype, dtype_to_descr

from .._pipeline import Pipeline
from ..errors import PipelineError, PipelineSpecError, describe, stage_failure
from ._shm import ShmFile
from .children import ChildTraceback


def ship(pipeline: Pipeline, runner: str, destination: str) -> bytes:
    """The pipeline as cloudpickle bytes, or an error naming the source or stage that cannot go."""
    try:
        return cloudpickle.dumps(pipeline)
    except Exception as exc:
        raise PipelineSpecError(
            f"{runner} runner: {_unpicklable_part(pipeline)} cannot be pickled to send it to "
            f"{destination} ({describe(exc)}). Create locks, open files and clients "
            f"inside the function instead of capturing them, or use runner='thread'.") from exc


def _unpicklable_part(pipeline: Pipeline) -> str:
    parts = [("the source", pipeline.source)]
    parts += [(f"stage {s.name!r} (its function)", s.fn) for s in pipeline.stages if s.fn is not None]
    for label, part in parts:
        try:
            cloudpickle.dumps(part)
        except Exception:
            return label
    return "the pipeline"


def unsendable_output(pipeline: Pipeline, index: int | None, exc: BaseException, runner: str,
                      destination: str) -> RemoteFailure:
    """An output that cannot be pickled to ``destination``, blamed on the last map (or source)."""
    maps = [s.name for s in pipeline.stages if s.kind == "map"]
    stage = maps[-1] if maps else "source"
    where = "the source" if stage == "source" else f"stage {stage!r}"
    item = f" on item {index}" if index is not None else ""
    return RemoteFailure.of(stage_failure(stage, index, exc, message=(
        f"{runner} runner: {where} returned an object{item} that cannot be sent to {destination} "
        f"({describe(exc)}). The pipeline stopped. Return picklable values from it (arrays, "
        f"tensors, numbers, strings, and lists, tuples or dicts of them): create locks, "
        f"generators and open files where the batch is used instead, or use runner='thread'.")))


def pickled(exc: BaseException, dumps: Callable[[Any], bytes] = pickle.dumps) -> bytes | None:
    """An exception as bytes that load back (some pickle, yet cannot be rebuilt), or None."""
    with contextlib.suppress(Exception):
        data = dumps(exc)
        pickle.loads(data)
        return data
    return None


@dataclass
class RemoteFailure:
    """A child's ``PipelineError``, sent instead of an output; its cause pickled, or as text."""

    message: str
    stage: str
    index: int | None
    cause: bytes | None
    traceback: str

    @classmethod
    def of(cls, error: PipelineError) -> RemoteFailure:
        cause = error.__cause__
        text = "".join(traceback.format_exception(cause)) if cause is not None else ""
        sent = None if cause is None else pickled(cause)
        return cls(str(error), error.stage, error.index, sent, text)

    def error(self) -> PipelineError:
        cause = None
        with contextlib.suppress(Exception):  # else the traceback's text stands for it
            cause = None if self.cause is None else pickle.loads(self.cause)  # from our own child
        remote = ChildTraceback(self.traceback) if self.traceback else None
        if cause is None:
            cause = remote
        elif remote is not None:
            cause.__cause__ = remote
        return stage_failure(self.stage, self.index, cause, message=self.message)


_ALIGN = 64
#: Slots grow to fit the largest output, with headroom: batches of varying size reuse a slot.
_MIN_SLOT = 1 << 20
_GROWTH = 1.25


class Encoded(NamedTuple):
    """An output ready to send: pickle bytes plus the arrays to copy into a slot (at their offsets)."""

    meta: bytes
    arrays: list[tuple[int, Any]]
    nbytes: int


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
        if (torch is not None and type(obj) is torch.Tensor and obj.device.type == "cpu"
                and obj.layout == torch.strided
                and not (obj.requires_grad or obj.is_quantized or obj.is_conj() or obj.is_neg())):
            return ("pt", self._place(obj, obj.nbytes), str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return None


def encode(obj: Any) -> Encoded:
    encoder = _Encoder(buffer := io.BytesIO())
    encoder.dump(obj)
    return Encoded(buffer.getvalue(), encoder.arrays, encoder.nbytes)


def write_arrays(encoded: Encoded, shm: ShmFile, copier: Copier | None = None) -> None:
    """Copy each array's bytes into the slot at its offset (one copy, strides honoured); with a
    ``copier``, by several threads: one copying thread can be the pipeline's limit."""
    pieces = [piece for offset, obj in encoded.arrays for piece in _pieces(offset, obj, shm)]
    if copier is None or encoded.nbytes < SPLIT_BYTES or len(pieces) < 2:
        _copy_all(pieces)
    else:
        copier.run(pieces)


#: Outputs smaller than this are copied by one thread: handing off costs more than it saves.
SPLIT_BYTES = 8 << 20
#: Arrays are cut along their first axis into pieces of about this size (a stacked batch too).
_PIECE_BYTES = 4 << 20


def _pieces(offset: int, obj: Any, shm: ShmFile) -> list[tuple[Any, Any]]:
    """(destination view in the slot, source) pairs that together copy ``obj``."""
    nbytes = obj.nbytes
    if not nbytes:
        return []
    if isinstance(obj, np.ndarray):
        dest = np.frombuffer(shm.map, dtype=obj.dtype, count=obj.size, offset=offset).reshape(obj.shape)
    else:
        torch = sys.modules["torch"]
        dest = torch.frombuffer(shm.map, dtype=obj.dtype, count=obj.numel(), offset=offset).view(obj.shape)
    rows = obj.shape[0] if obj.ndim else 1
    parts = min(rows, max(1, nbytes // _PIECE_BYTES))
    if parts <= 1:
        return [(dest, obj)]
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [(dest[a:b], obj[a:b]) for a, b in zip(bounds, bounds[1:])]


def _copy_all(pieces: list[tuple[Any, Any]]) -> None:
    for dest, src in pieces:
        if isinstance(dest, np.ndarray):
            np.copyto(dest, src, casting="no")  # releases the GIL for large arrays
        else:
            dest.copy_(src)


class Copier:
    """Threads that copy pieces of an output beside the caller (copies release the GIL)."""

    def __init__(self, helpers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="spdl_lab:copy")
        self._helpers = helpers

    def run(self, pieces: list[tuple[Any, Any]]) -> None:
        shares: list[list[tuple[Any, Any]]] = [[] for _ in range(self._helpers + 1)]
        loads = [0] * len(shares)
        for piece in sorted(pieces, key=lambda p: -p[1].nbytes):
            i = loads.index(min(loads))
            shares[i].append(piece)
            loads[i] += piece[1].nbytes
        futures = [self._pool.submit(_copy_all, share) for share in shares[1:] if share]
        _copy_all(shares[0])
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def decode(meta: bytes, shm: ShmFile | None, lease: Any = None) -> Any:
    """The output ``meta`` describes: arrays copied out of ``shm``, or views of it held by ``lease``."""
    return _Decoder(io.BytesIO(meta), shm, lease).load()


class _Decoder(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shm: ShmFile | None, lease: Any) -> None:
        super().__init__(file)
        self._shm = shm
        self._lease = lease

    def persistent_load(self, pid: Any) -> Any:
        kind, offset, dtype, shape = pid
        count = int(np.prod(shape, dtype=np.int64))
        buffer = self._lease if self._lease is not None else self._shm.map  # type: ignore[union-attr]
        if kind == "nd":
            lib, dt, copy = np, descr_to_dtype(dtype), np.ndarray.copy
        else:
            import torch
            lib, dt, copy = torch, getattr(torch, dtype), torch.Tensor.clone
        if count == 0:
            return lib.empty(shape, dtype=dt)
        view = lib.frombuffer(buffer, dtype=dt, count=count, offset=offset).reshape(shape)
        return view if self._lease is not None else copy(view)


class Leases:
    """Parent side: which slots are lent to the consumer as views, and which came back. A lease's
    finalizer (in whatever thread drops the last view) only queues the slot: safe anywhere."""

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._lent = 0
        self._back: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._types: dict[int, type] = {}

    def lend(self, slot_id: int, shm: ShmFile) -> Any:
        """A lease on the slot, or None where lending it would leave the child none to fill."""
        if self._lent >= self._slots - 1:
            return None
        kind = self._types.get(shm.size)
        if kind is None:
            kind = self._types[shm.size] = type("Lease", (ctypes.c_char * shm.size,), {})
        lease = kind.from_buffer(shm.map)
        weakref.finalize(lease, self._back.put, slot_id)
        self._lent += 1
        return lease

    def returned(self) -> list[int]:
        """Slots whose views are all gone since the last call."""
        back = [self._back.get() for _ in range(self._back.qsize())]  # others only add
        self._lent -= len(back)
        return back


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
            with contextlib.suppress(queue.Empty):
                slot_id = self._free.get(timeout=0.1)
                break
            if stopping():
                raise InterruptedError("stopping")
        shm = self._slots[slot_id]
        if shm is None or shm.size < nbytes:
            if shm is not None:
                shm.close()
                shm.unlink()
                self._slots[slot_id] = None
            self._made += 1
            size = max(_MIN_SLOT, int(nbytes * _GROWTH))
            try:
                shm = ShmFile(f"{self._prefix}slot{slot_id}_{self._made}", size, create=True,
                              purpose="the transfer buffer of an output")
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
