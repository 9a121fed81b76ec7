"""Tool calls in worker processes (GRPOConfig.tool_isolation='process'): both sides of the pipe.

The trainer keeps a small pool of worker processes (`ToolWorkers`, at most `MAX_WORKERS`, started on first
use, reused across calls). A call is sent to an idle worker as one JSON line; the worker runs the tool, turns
its value into text (`outcome.call_tool`) and answers with one JSON line. Only JSON crosses back: the trainer
never unpickles anything a worker sends.

What a worker bounds:
    - memory: RLIMIT_DATA of `memory_mb` (the heap and every private writable mapping), so a tool that
      allocates from model input gets MemoryError, recorded as that call's error, instead of the kernel's OOM
      killer taking the trainer; the worker also volunteers as the OOM killer's first choice (oom_score_adj
      1000);
    - time and CPU: a call past its timeout gets its worker (and the worker's process group) SIGKILLed and
      replaced, so a spinning tool never holds the trainer's GIL or a CPU after its timeout;
    - the trainer's life: a worker dies with the trainer (PR_SET_PDEATHSIG) and exits when its pipe closes.
It is not a jail: a tool keeps the trainer's environment variables, files and network, as it needs them to
do its job. Untrusted code belongs in forge.tools.sandbox.run_python (which a tool may call).

How a tool reaches a worker: a module-level function by its module and name (a module loaded from a file, as
`forge train --tools path/to/tools.py:fn` does, by its file; a function of the script you run by running that
script as `__mp_main__`, so its `if __name__ == "__main__":` block is skipped, as multiprocessing does); any
other callable by pickle (a functools.partial of a function, an instance of a module-level class). A lambda,
a function defined inside another function (a closure) or an object that cannot be pickled cannot reach
another process: `portable_reference` refuses it with a message when the settings are built.
"""

from __future__ import annotations

import atexit
import base64
import importlib
import importlib.util
import json
import os
import pickle
import selectors
import signal
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from forge.tools.outcome import call_tool, describe_error

__all__ = ["MAX_WORKERS", "ToolWorkers", "portable_reference", "serve"]

# calls beyond this many at once wait for a free worker (each call's timeout starts when it runs)
MAX_WORKERS = 8
START_TIMEOUT = 120.0  # seconds a new worker may take to import its tools (not counted in any call's timeout)
_REPLY_SLACK = 65536  # bytes a reply may hold beyond its text (escapes are counted separately)
_POOLS: weakref.WeakSet = weakref.WeakSet()


# ----------------------------------------------------------------------------------------------------
# The trainer's side


def portable_reference(function: Callable[..., Any]) -> dict:
    """How a worker process finds `function` (see the module docstring); ValueError for one it cannot."""
    qualname = getattr(function, "__qualname__", None) or ""
    if isinstance(function, types.FunctionType):
        if "<lambda>" in qualname or "<locals>" in qualname:
            raise ValueError(_not_portable(function,
                                           "a lambda or a function defined inside another function"))
        module = sys.modules.get(function.__module__)
        if (function.__module__ != "__main__" and module is not None
                and _resolve(module, qualname) is function):
            return {"kind": "import", "module": function.__module__, "qualname": qualname}
        path = function.__code__.co_filename
        if os.path.isfile(path):
            return {"kind": "file", "path": os.path.abspath(path), "qualname": qualname,
                    "main": function.__module__ == "__main__"}
        raise ValueError(_not_portable(function, f"its source file {path!r} cannot be found"))
    try:
        return {"kind": "pickle", "data": base64.b64encode(pickle.dumps(function)).decode("ascii")}
    except Exception as error:  # noqa: BLE001 - any pickling failure means the same thing here
        raise ValueError(_not_portable(function, f"it cannot be pickled ({describe_error(error)})")) from None


def _not_portable(function: Any, why: str) -> str:
    name = getattr(function, "__name__", type(function).__name__)
    return (
        f"tool {name!r} cannot run in a worker process (tool_isolation='process'): {why}. Define it at the "
        "top level of a module (or pass a picklable callable), or set tool_isolation='thread'"
    )


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self, setup: dict):
        call_read, self.call_write = os.pipe()
        self.result_read, result_write = os.pipe()
        bootstrap = (
            f"import sys; sys.path[:] = {json.dumps(sys.path)}; from forge.tools.worker import serve; "
            f"serve({call_read}, {result_write})"
        )
        try:
            self.process = subprocess.Popen([sys.executable, "-c", bootstrap], stdin=subprocess.DEVNULL,
                                            pass_fds=(call_read, result_write), start_new_session=True,
                                            cwd=os.getcwd())
        finally:
            os.close(call_read)
            os.close(result_write)
        self.buffer = b""
        self.started = time.perf_counter()
        self.send(setup)

    def send(self, message: dict) -> bool:
        data = (json.dumps(message) + "\n").encode("utf-8")
        try:
            while data:
                data = data[os.write(self.call_write, data):]
        except OSError:  # the worker is gone (BrokenPipeError)
            return False
        return True

    def read_reply(self, limit: int) -> dict | None | str:
        """A finished reply (dict), None while incomplete, or why the worker can no longer answer (str)."""
        try:
            chunk = os.read(self.result_read, 1 << 16)
        except OSError as error:
            return f"its pipe failed ({error})"
        if not chunk:
            self.process.wait()
            return f"its process ended (exit status {self.process.returncode}) during the call"
        self.buffer += chunk
        if b"\n" not in self.buffer:
            return "it sent a reply too long to be a tool result" if len(self.buffer) > limit else None
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            return "it sent an unreadable reply"
        return reply if isinstance(reply, dict) else "it sent an unreadable reply"

    def kill(self) -> None:
        try:
            # the worker and anything its tools started in its group
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for fd in (self.call_write, self.result_read):
            try:
                os.close(fd)
            except OSError:
                pass


class ToolWorkers:
    """The worker processes of one run's tools. `run` is what run_calls uses; `check` starts one worker and
    raises ValueError when it cannot load the tools (so a run fails at its start, not at its first call)."""

    def __init__(self, functions: dict[str, Callable[..., Any]], memory_mb: int,
                 max_workers: int = MAX_WORKERS):
        if os.environ.get("FORGE_TOOL_WORKER"):
            raise RuntimeError(
                "a tool worker process is starting tool workers of its own: the script that defines "
                "the tools runs again in each worker, training code included; put that code under "
                '`if __name__ == "__main__":` (or the tools in a module of their own)'
            )
        self.setup = {"tools": {name: portable_reference(f) for name, f in functions.items()},
                      "memory_mb": memory_mb}
        self.memory_mb = memory_mb
        self.max_workers = max_workers
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()
        _POOLS.add(self)

    # a copy of the settings gets its own (not yet started) workers
    def __deepcopy__(self, memo) -> ToolWorkers:
        copy = ToolWorkers.__new__(ToolWorkers)
        copy.setup, copy.memory_mb, copy.max_workers = self.setup, self.memory_mb, self.max_workers
        copy.idle, copy.lock = [], threading.Lock()
        _POOLS.add(copy)
        return copy

    def __getstate__(self) -> dict:
        return {"setup": self.setup, "memory_mb": self.memory_mb, "max_workers": self.max_workers}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, idle=[], lock=threading.Lock())
        _POOLS.add(self)

    def check(self) -> None:
        with self.lock:
            workers, problems = self._start(1)
            if problems:
                raise ValueError(f"tool_isolation='process': {problems[0]}")
            self.idle += workers

    def close(self) -> None:
        with self.lock:
            for worker in self.idle:
                worker.kill()
            self.idle = []

    def run(self, jobs: Sequence[tuple[str, dict]], timeout: float,
            max_output_chars: int) -> list[tuple[str, str | None, bool, float]]:
        """(text, failure, truncated, seconds) of each (tool name, arguments) job; failure None | 'error' |
        'timeout'. Jobs run in parallel, at most `max_workers` at once."""
        with self.lock:
            return self._run(list(jobs), timeout, max_output_chars)

    def _run(self, jobs: list[tuple[str, dict]], timeout: float, max_output_chars: int) -> list:
        outcomes: list[Any] = [None] * len(jobs)
        waiting = list(range(len(jobs)))
        busy: dict[int, tuple[_Worker, float]] = {}  # job -> (worker, started)
        limit = 12 * max_output_chars + _REPLY_SLACK  # JSON escapes take at most 12 bytes per character
        with selectors.DefaultSelector() as selector:
            while waiting or busy:
                wanted = min(len(waiting), self.max_workers - len(busy))
                if wanted > len(self.idle):
                    started, problems = self._start(wanted - len(self.idle))
                    self.idle += started
                    if problems and not self.idle and not busy:  # no worker can run them: each call fails
                        for job in waiting:
                            outcomes[job] = (
                                f"error: the tool's worker process could not start: {problems[0]}",
                                "error",
                                False,
                                0.0,
                            )
                        waiting = []
                self._send_waiting(jobs, waiting, busy, outcomes, selector, max_output_chars)
                if not busy:
                    continue
                first_deadline = min(started for _, started in busy.values()) + timeout
                for key, _ in selector.select(max(0.0, first_deadline - time.perf_counter())):
                    job = key.data
                    worker, started = busy[job]
                    reply = worker.read_reply(limit)
                    if reply is None:
                        continue
                    selector.unregister(worker.result_read)
                    del busy[job]
                    outcomes[job] = self._outcome(worker, reply, time.perf_counter() - started)
                now = time.perf_counter()
                for job, (worker, started) in list(busy.items()):
                    if now - started >= timeout:
                        selector.unregister(worker.result_read)
                        del busy[job]
                        worker.kill()  # it may be spinning: it must not keep a CPU
                        outcomes[job] = (f"error: the call took longer than {timeout:g} s and was stopped",
                                         "timeout", False, now - started)
        return outcomes

    def _send_waiting(self, jobs: list[tuple[str, dict]], waiting: list[int], busy: dict, outcomes: list,
                      selector: selectors.BaseSelector, max_output_chars: int) -> None:
        """Hand waiting jobs to idle workers while there are both and room under max_workers; a job that
        cannot be sent gets its error outcome at once."""
        while waiting and self.idle and len(busy) < self.max_workers:
            job, worker = waiting.pop(0), self.idle.pop()
            name, arguments = jobs[job]
            try:
                request = {"tool": name, "arguments": arguments, "max_output_chars": max_output_chars}
                sent = worker.send(request)
            except (TypeError, ValueError) as error:  # arguments JSON cannot carry
                self.idle.append(worker)
                text = f"error: the arguments cannot be sent to a worker process: {describe_error(error)}"
                outcomes[job] = (text, "error", False, 0.0)
                continue
            if not sent:
                worker.kill()
                ended = "error: the tool's worker process ended before the call"
                outcomes[job] = (ended, "error", False, 0.0)
                continue
            busy[job] = (worker, time.perf_counter())
            selector.register(worker.result_read, selectors.EVENT_READ, job)

    def _outcome(self, worker: _Worker, reply: Any, seconds: float) -> tuple[str, str | None, bool, float]:
        """A call's outcome from its worker's reply; the worker goes back to the idle ones, or is killed when
        the reply is not one."""
        if isinstance(reply, dict) and isinstance(reply.get("text"), str):
            self.idle.append(worker)
            return (reply["text"], "error" if reply.get("failure") else None, bool(reply.get("truncated")),
                    seconds)
        worker.kill()
        why = reply if isinstance(reply, str) else "it sent an unreadable reply"
        text = f"error: the tool's worker process failed: {why}"
        if "exit status -" in why:  # killed by a signal: the kernel, short of memory?
            text += f" (a tool may use at most tool_memory_mb={self.memory_mb} MB)"
        return (text, "error", False, seconds)

    def _start(self, count: int) -> tuple[list[_Worker], list[str]]:
        """Start `count` workers at once and wait until each has loaded the tools: (ready ones, problems)."""
        starting = []
        for _ in range(count):
            try:
                starting.append(_Worker(self.setup))
            except OSError as error:
                return [], [f"{sys.executable}: {error}"]
        ready, problems = [], []
        for worker in starting:
            reply = None
            deadline = worker.started + START_TIMEOUT
            with selectors.DefaultSelector() as selector:
                selector.register(worker.result_read, selectors.EVENT_READ)
                while reply is None and selector.select(max(0.0, deadline - time.perf_counter())):
                    reply = worker.read_reply(1 << 20)
            if isinstance(reply, dict) and reply.get("ready"):
                ready.append(worker)
                continue
            worker.kill()
            problems.append(reply.get("error", "no answer") if isinstance(reply, dict) else
                            reply or f"it did not load the tools within {START_TIMEOUT:g} s")
        return ready, problems


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


# ----------------------------------------------------------------------------------------------------
# The worker's side


def serve(call_fd: int, result_fd: int) -> None:
    """The worker's main loop: read the setup, bound this process, load the tools, then answer calls until the
    trainer closes the pipe."""
    calls = os.fdopen(call_fd, "rb")
    replies = os.fdopen(result_fd, "wb", buffering=0)

    def reply(message: dict) -> None:
        replies.write((json.dumps(message) + "\n").encode("utf-8"))

    setup = json.loads(calls.readline())
    os.environ["FORGE_TOOL_WORKER"] = "1"  # a script that builds a trainer at import time must not recurse
    _bound_this_process(setup["memory_mb"])
    try:
        tools = {name: _load(reference) for name, reference in setup["tools"].items()}
    except BaseException as error:  # noqa: BLE001 - reported to the trainer, which refuses to start the run
        hint = (f" (tool_memory_mb={setup['memory_mb']} counts the memory of the tools' imports too)"
                if isinstance(error, MemoryError) else "")
        reply({"error": f"could not load the tools: {describe_error(error)}{hint}"})
        return
    reply({"ready": True})
    for line in calls:
        request = json.loads(line)
        text, failure, truncated = call_tool(tools[request["tool"]], request["arguments"],
                                             request["max_output_chars"])
        reply({"text": text, "failure": failure, "truncated": truncated})


def _bound_this_process(memory_mb: int) -> None:
    import ctypes
    import resource

    if memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_mb * 2**20, memory_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer
    except (OSError, AttributeError):
        pass


def _load(reference: dict) -> Callable[..., Any]:
    if reference["kind"] == "pickle":
        return pickle.loads(base64.b64decode(reference["data"]))  # written by the trainer, not by a tool
    if reference["kind"] == "import":
        return _found(_resolve(importlib.import_module(reference["module"]), reference["qualname"]),
                      reference)
    path = reference["path"]
    name = "__mp_main__" if reference["main"] else f"forge_tool_file_{abs(hash(path))}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if reference["main"]:
            sys.modules["__main__"] = module
        spec.loader.exec_module(module)
    return _found(_resolve(module, reference["qualname"]), reference)


def _found(function: Any, reference: dict) -> Callable[..., Any]:
    if not callable(function):
        where = reference.get("module") or reference["path"]
        raise LookupError(f"{where} has no function {reference['qualname']}")  # noqa: TRY004
    return function


def _resolve(owner: Any, qualname: str) -> Any:
    """`owner.a.b` for qualname 'a.b' (None when missing)."""
    for part in qualname.split("."):
        owner = getattr(owner, part, None)
    return owner
