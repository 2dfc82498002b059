"""One data folder for the workload tests: files are made once per test session, not in ~/.cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spdl_lab_data")
    before = os.environ.get("SPDL_LAB_CACHE_DIR")
    os.environ["SPDL_LAB_CACHE_DIR"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("SPDL_LAB_CACHE_DIR", None)
    else:
        os.environ["SPDL_LAB_CACHE_DIR"] = before
