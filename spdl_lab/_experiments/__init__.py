"""Experiments built on runners and telemetry: run (a background Session), compare, headspace."""
