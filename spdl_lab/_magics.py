"""IPython magics (``%load_ext spdl_lab``): %spdl_info, %spdl_run, %spdl_compare, %spdl_diagnose
and %spdl_attach. Names on a line (``pipe``, ``wl.pipeline``) are looked up in the notebook's
namespace, never evaluated, so a line cannot run arbitrary code."""

from __future__ import annotations

import difflib
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

import spdl_lab as lab
from spdl_lab._interpreter import describe
from spdl_lab._runners import RUNNERS

MAGICS: tuple[str, ...] = ("spdl_info", "spdl_run", "spdl_compare", "spdl_diagnose", "spdl_attach")

_ANY_PIPELINE = "a lab.Pipeline, a lab.Loader or any iterable"
_STEP = "a function that takes a batch, or a lab.SimulatedDevice"


@magics_class
class SpdlMagics(Magics):
    """The spdl_lab line magics; thin front ends over ``lab.run`` and ``lab.compare``."""

    @magic_arguments()
    @line_magic
    def spdl_info(self, line: str) -> None:
        """Print the interpreter (GIL, cores, torch, CUDA), the spdl_lab version and its runners."""
        parse_argstring(self.spdl_info, line)
        print("\n".join(describe().lines(lab.__version__, lab.RUNNERS)))

    @magic_arguments()
    @argument("pipeline", help="the pipeline, loader or iterable: a variable name or dotted path")
    @argument("--step", required=True, help="the training step: a variable name or dotted path")
    @argument("--runner", help=f"one of {', '.join(lab.RUNNERS)} (default: thread)")
    @argument("--steps", type=int, help="stop after this many steps")
    @argument("--duration", type=float, help="stop after this many seconds")
    @argument("--name", default="spdl_session", help="the variable that receives the Session (default spdl_session)")
    @line_magic
    def spdl_run(self, line: str) -> Any:
        """Start a training loop in the background; show its live dashboard."""
        args = self._parse("spdl_run", line)
        pipeline, step = self._inputs("spdl_run", args, _ANY_PIPELINE, [args.runner] if args.runner else None)
        session = lab.run(pipeline, step, runner=args.runner, steps=args.steps, duration=args.duration)
        return self._store_and_show("spdl_run", args.name, session, "the session")

    @magic_arguments()
    @argument("pipeline", help="the lab.Pipeline: a variable name or dotted path")
    @argument("--step", required=True, help="the training step: a variable name or dotted path")
    @argument("--runners", nargs="+", help=f"runners to compare (default: {', '.join(lab.LOCAL_RUNNERS)}; "
                                            f"any of {', '.join(lab.RUNNERS)})")
    @argument("--steps", type=int, help="measured steps per runner, over all rounds (default 200)")
    @argument("--warmup", type=int, help="warm-up steps per runner in each round (default 10)")
    @argument("--repeats", type=int, help="interleaved rounds; batches/s is the median of them (default 5)")
    @argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    @argument("--name", default="spdl_comparison",
              help="the variable that receives the Comparison (default spdl_comparison)")
    @line_magic
    def spdl_compare(self, line: str) -> Any:
        """Run the pipeline and step under each runner in interleaved rounds; show the Comparison."""
        args = self._parse("spdl_compare", line)
        pipeline, step = self._inputs("spdl_compare", args, "a lab.Pipeline", args.runners)
        given = _given(args, "runners", "steps", "warmup", "repeats", "progress")
        self.shell.user_ns[args.name] = out = lab.compare(pipeline, step, **given)
        return out

    @magic_arguments()
    @argument("pipeline", help="the lab.Pipeline: a variable name or dotted path")
    @argument("--concurrency", type=int, nargs="+", help="thread counts to sweep (default: 1 2 4 8 16)")
    @argument("--num-items", type=int, help="inputs collected from the source (default 100)")
    @argument("--no-processes", dest="processes", action="store_false",
              help="skip the process-pool sweep of stages that do not scale with threads")
    @argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    @argument("--name", default="spdl_diagnosis",
              help="the variable that receives the Diagnosis (default spdl_diagnosis)")
    @line_magic
    def spdl_diagnose(self, line: str) -> Any:
        """Profile each stage alone, sweeping concurrency; show the verdicts."""
        args = self._parse("spdl_diagnose", line)
        pipeline = self._lookup("spdl_diagnose", args.pipeline, "a lab.Pipeline")
        given = _given(args, "concurrency", "num_items", "processes", "progress")
        self.shell.user_ns[args.name] = out = lab.diagnose(pipeline, **given)
        return out

    @magic_arguments()
    @argument("run", help="the published run's name or pid (lab.attach() lists them)")
    @argument("--timeout", type=float, default=10.0, help="seconds to wait for the run to appear")
    @argument("--name", default="spdl_remote",
              help="the variable that receives the RemoteSession (default spdl_remote)")
    @line_magic
    def spdl_attach(self, line: str) -> Any:
        """Attach to a run a script published (lab.publish, spdl-lab watch); show its dashboard."""
        args = self._parse("spdl_attach", line)
        run: str | int = int(args.run) if args.run.isdigit() else args.run
        try:
            remote = lab.attach(run, timeout=args.timeout)
        except lab.SpdlLabError as exc:
            raise UsageError(f"%spdl_attach: {exc}") from None
        return self._store_and_show("spdl_attach", args.name, remote, "the RemoteSession")

    def _parse(self, magic: str, line: str) -> Any:
        args = parse_argstring(getattr(self, magic), line)
        if not args.name.isidentifier():
            raise UsageError(f"%{magic}: --name {args.name!r} is not a valid variable name")
        return args

    def _inputs(self, magic: str, args: Any, what: str, runners: list[str] | None) -> tuple[Any, Any]:
        pipeline, step = self._lookup(magic, args.pipeline, what), self._lookup(magic, args.step, _STEP)
        if unknown := [r for r in runners or [] if r not in RUNNERS]:
            raise UsageError(f"%{magic}: unknown runner {', '.join(map(repr, unknown))}; "
                             f"choose from {', '.join(RUNNERS)}")
        return pipeline, step

    def _store_and_show(self, magic: str, name: str, session: Any, what: str) -> Any:
        """Store ``session``; its dashboard, or itself (saying why) where there can be none."""
        self.shell.user_ns[name] = session
        try:
            return session.dashboard()
        except lab.SpdlLabError as exc:
            print(f"%{magic}: no dashboard ({exc}); {what} is in {name!r}")
            return session

    def _lookup(self, magic: str, path: str, what: str) -> Any:
        """The object named by ``path`` (``x`` or ``x.attr.attr``) in the user's namespace."""
        parts = path.split(".")
        if not all(part.isidentifier() for part in parts):
            raise UsageError(f"%{magic}: {path!r} is not a variable name; assign it first "
                             "(x = ...) and pass the name or a dotted path like wl.pipeline "
                             "(expressions are not evaluated)")
        ns = self.shell.user_ns
        if parts[0] not in ns:
            visible = [k for k in ns if not k.startswith("_") and k not in self.shell.user_ns_hidden]
            close = difflib.get_close_matches(parts[0], visible, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UsageError(f"%{magic}: no variable {parts[0]!r} in the notebook's namespace; "
                             f"define it first ({what}){hint}")
        obj = ns[parts[0]]
        for i, attr in enumerate(parts[1:], 1):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise UsageError(f"%{magic}: {'.'.join(parts[:i])!r} ({type(obj).__name__}) has no "
                                 f"attribute {attr!r}") from None
        return obj


def _given(args: Any, *names: str) -> dict[str, Any]:
    """The options given on the line: the API's defaults stay the one source of truth."""
    return {k: getattr(args, k) for k in names if getattr(args, k) is not None}


def load_ipython_extension(ipython: Any) -> None:
    """Register the magics once; loading again (``%reload_ext``) replaces nothing twice."""
    if SpdlMagics.__name__ not in ipython.magics_manager.registry:
        ipython.register_magics(SpdlMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """Undo ``load_ipython_extension``: drop our magics and our registry entry."""
    manager = ipython.magics_manager
    if (ours := manager.registry.pop(SpdlMagics.__name__, None)) is None:
        return
    table = manager.magics["line"]
    for name in MAGICS:
        # Only if still ours: another extension may have taken the name since.
        if getattr(table.get(name), "__self__", None) is ours:
            del table[name]
