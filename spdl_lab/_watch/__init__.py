"""Watching a training script from a notebook: the script publishes its run (``publish``: a
record file and a local endpoint) and a notebook attaches to it (``attach``), live or after."""
