"""subprocess-threads hands the consumer views of the shared-memory slot, reused only when safe.

The rule (spdl_lab/_runners/_transport.py): an output's arrays are views of its
slot while lending it leaves the child a free slot; the slot goes back to the
child when the last view is garbage. Beyond that, outputs are copied.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import spdl_lab as lab
from spdl_lab._runners.subprocess_threads import SLOTS

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


def make(i):
    return np.full((256, 256), i, dtype=np.float64), torch.full((64,), i, dtype=torch.int32)


def _pipeline(n):
    return lab.Pipeline(range(n)).map(make, concurrency=2, name="make")


def _owns_nothing(arr) -> bool:
    return not arr.flags.owndata


@pytest.mark.timeout(60)
def test_outputs_are_views_of_the_slot_and_stay_intact_while_held():
    held = []
    with lab.Loader(_pipeline(40).map(lambda x: x, name="keep", ordered=True), runner="subprocess-threads") as loader:
        for i, (arr, t) in enumerate(loader):
            if i == 0:
                assert _owns_nothing(arr), "the first output should be a view of the slot, not a copy"
                held.append((arr, t))  # keeps its slot lent for the rest of the run
            assert arr[0, 0] == arr[-1, -1] and int(t[0]) == int(arr[0, 0])
    first, first_t = held[0]
    # Every later output went through the other slots: the held one was never overwritten.
    assert np.all(first == first[0, 0]) and torch.all(first_t == int(first[0, 0]))


@pytest.mark.timeout(60)
def test_a_consumer_that_keeps_everything_never_stalls_the_child():
    n = 6 * SLOTS
    with lab.Loader(_pipeline(n).map(lambda x: x, name="keep", ordered=True), runner="subprocess-threads") as loader:
        everything = list(loader)  # would hang if every slot stayed lent
    assert len(everything) == n
    views = sum(_owns_nothing(arr) for arr, _ in everything)
    assert 1 <= views <= SLOTS - 1  # the rest were copied
    for arr, t in everything:
        assert np.all(arr == arr[0, 0]) and torch.all(t == int(arr[0, 0]))
    assert sorted(int(arr[0, 0]) for arr, _ in everything) == list(range(n))


@pytest.mark.timeout(60)
def test_a_slot_comes_back_when_its_views_are_gone():
    with lab.Loader(_pipeline(10 * SLOTS), runner="subprocess-threads") as loader:
        views = 0
        for arr, t in loader:
            views += _owns_nothing(arr)
            del arr, t  # plain reference counting frees the views: no gc.collect() needed
    # Dropping each output before the next read returns its slot: every output can be lent.
    assert views == 10 * SLOTS


@pytest.mark.timeout(60)
def test_views_outlive_the_loader():
    with lab.Loader(_pipeline(8), runner="subprocess-threads") as loader:
        kept = [next(iter(loader))]
    arr, t = kept[0]
    assert np.all(arr == arr[0, 0]) and torch.all(t == int(arr[0, 0]))
    arr += 1  # still mapped and writable after close
    del kept, arr, t
    gc.collect()


def test_a_large_output_is_copied_by_several_threads_byte_for_byte():
    import threading

    from spdl_lab._runners._shm import ShmFile
    from spdl_lab._runners._transport import SPLIT_BYTES, Copier, decode, encode, write_arrays

    rng = np.random.default_rng(0)
    stacked = rng.random((64, 64, 300))  # one array larger than SPLIT_BYTES: cut into pieces
    output = {"batch": stacked, "items": [rng.random((100, 150)) for _ in range(20)],
              "labels": torch.arange(1000), "strided": stacked[:, ::2, 1], "empty": np.empty((0, 3))}
    encoded = encode(output)
    assert encoded.nbytes > SPLIT_BYTES
    before = {t.name for t in threading.enumerate()}
    copier = Copier(helpers=2)
    shm = ShmFile(f"spdl_lab_test_copier_{os.getpid()}", encoded.nbytes, create=True)
    try:
        write_arrays(encoded, shm, copier)
        got = decode(encoded.meta, shm)  # copies out
    finally:
        copier.close()
        shm.close()
        shm.unlink()
    assert np.array_equal(got["batch"], stacked) and np.array_equal(got["strided"], stacked[:, ::2, 1])
    assert all(np.array_equal(a, b) for a, b in zip(got["items"], output["items"]))
    assert torch.equal(got["labels"], output["labels"]) and got["empty"].shape == (0, 3)
    assert {t.name for t in threading.enumerate()} == before  # the copier's threads are gone
