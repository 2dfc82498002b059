"""Every reliability test runs under the hygiene check (see ``hygiene.py``)."""

from __future__ import annotations

import pytest
from hygiene import Hygiene


@pytest.fixture(autouse=True)
def hygiene():
    """Fails the test if it leaves threads, children, /dev/shm entries or descriptors behind.

    A test that expects the library to abandon stuck threads says so with
    ``hygiene.allow_abandoned("spdl_lab:<stage>:")``.
    """
    check = Hygiene()
    check.begin()
    yield check
    check.finish()
