"""Watching a training script from a notebook: the script publishes its telemetry
(``records``: a pandas-readable record file; ``endpoint``: a local socket), and
a notebook attaches to it. Work in progress (issue 17)."""
