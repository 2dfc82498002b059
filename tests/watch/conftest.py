"""Every watch test runs in its own tmp_path: a record written to the default place
(``./spdl_lab_runs``) lands there, never in the repository."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
