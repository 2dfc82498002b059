"""Put first on PYTHONPATH by ``spdl-lab watch``: loads the watch hook (``spdl_lab._watch.hook``)
without importing spdl_lab, then runs the sitecustomize this one hides, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if "spdl_lab_watch_hook" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("spdl_lab_watch_hook", os.path.join(_here, "..", "hook.py"))
    _hook = importlib.util.module_from_spec(_spec)
    sys.modules["spdl_lab_watch_hook"] = _hook
    _spec.loader.exec_module(_hook)
    _hook.install()

# The next sitecustomize on the path (a site's or a virtualenv's) still runs.
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    sys.modules["sitecustomize"] = _module
    _next.loader.exec_module(_module)
