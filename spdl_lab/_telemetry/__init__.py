"""Telemetry: meters on the hot path, probes, the sampler, frames and snapshots."""
