"""Every reliability test runs under the hygiene check (see ``hygiene.py``)."""

from __future__ import annotations

import pytest
from hygiene import Hygiene


@pytest.fixture(autouse=True)
def hygiene(request):
    """Fails the test if it leaves threads, children, /dev/shm entries or descriptors behind.

    A test that expects the library to abandon stuck threads says so with
    ``hygiene.allow_abandoned("spdl_lab:<stage>:")``. A ``runner="ray"`` case runs on the
    session's shared Ray instance (``ray_instance``), opened before the first snapshot: its
    processes and connections belong to the instance, and the check asks instead that the
    run's own actors and Ray Data's threads are gone.
    """
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    shared_ray = params.get("runner") == "ray"
    if shared_ray:
        request.getfixturevalue("ray_instance")
    check = Hygiene(shared_ray=shared_ray)
    check.begin()
    yield check
    check.finish()
