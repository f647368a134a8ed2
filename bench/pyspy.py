"""py-spy on a bench's processes while a run goes, and the top functions of each profile.

`Profiler(select, out)` attaches `py-spy record` to every process `select` names (polled twice a second,
so worker processes an engine starts during the run are caught too) and stops them on exit; `summary`
reads the collapsed stacks back: each function's share of the samples, inclusive and on top of the stack.
py-spy must be installed (`pip install py-spy`); without it the profiler says so and records nothing.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil

PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
RATE = 50  # samples a second: enough for a share, light enough not to move the figures much
# Leaves where a thread waits rather than works (py-spy --nonblocking cannot tell them idle itself).
WAITS = tuple(
    "." + name
    for name in ("select", "wait", "join", "get", "sleep", "_worker", "poll", "acquire", "main_loop")
)


def rollflow_command(proc: psutil.Process) -> str | None:
    """ "command" for a `rollflow run` process, else None: the selector of the process a bench drives."""
    cmd = proc.cmdline()
    return "command" if len(cmd) > 2 and cmd[1].endswith("/rollflow") and cmd[2] == "run" else None


class Profiler:
    def __init__(
        self, select: Callable[[psutil.Process], str | None], out: Path, prefix: str, rate: int = RATE
    ) -> None:
        self.select, self.out, self.prefix, self.rate = select, out, prefix, rate
        self.spies: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _attach(self) -> None:
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                kind = self.select(proc)
                if kind is None or proc.pid in self.spies:
                    continue
                path = self.out / f"{self.prefix}-{kind}-{proc.pid}.txt"
                cmd = [PY_SPY, "record", "--pid", str(proc.pid), "--rate", str(self.rate), "--format", "raw",
                       "--nonblocking", "--threads", "-o", str(path)]  # fmt: skip
                spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.spies[proc.pid] = (kind, spy)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self._attach()

    def __enter__(self) -> Profiler:
        if not Path(PY_SPY).exists():
            print("py-spy is not installed (pip install py-spy): no profile recorded", file=sys.stderr)
            return self
        self.out.mkdir(parents=True, exist_ok=True)
        self._attach()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for _, spy in self.spies.values():
            with contextlib.suppress(ProcessLookupError):
                spy.send_signal(signal.SIGINT)
        for _, spy in self.spies.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy.wait(20)


def _frames(stack: str) -> list[str]:
    """`thread;func (file:line);...` -> the function names with their module, outermost first."""
    names = []
    for frame in stack.split(";"):
        name, _, where = frame.partition(" (")
        module = where.split(":")[0].rsplit("/", 1)[-1].removesuffix(".py")
        names.append(f"{module}.{name}" if where else name)
    return names


def summary(paths: list[Path], top: int = 25, within: tuple[str, ...] = ()) -> str:
    """The profiles in `paths` added up: samples, then the top functions by inclusive and by self share.

    With `within`, only the samples whose stack has a function whose name holds one of them (one stage).
    """
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = waiting = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            frames = _frames(stack)
            if within and not any(part in frame for frame in frames for part in within):
                continue
            if len(frames) < 2 or frames[-1].endswith(WAITS):  # a thread with no Python frame: native
                waiting += n
                continue
            total += n
            own[frames[-1]] += n
            for name in set(frames[1:]):  # the first frame is the thread's name
                inclusive[name] += n
    if not total:
        return "  (no samples)"
    lines = [
        f"  {total} samples at work ({waiting} more waiting: select, locks, queues, sleep)",
        "  inclusive:",
    ]
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    lines.append("  self:")
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top)]
    return "\n".join(lines)
