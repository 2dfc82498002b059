"""Experiments built on runners and telemetry: headspace (more to come: run, compare, diagnose)."""

from .headspace import headspace

__all__ = ["headspace"]
