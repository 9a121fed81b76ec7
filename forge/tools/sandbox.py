"""Run untrusted Python (e.g. code a model wrote) in a child process with time, memory and output limits.

A code-execution reward must run programs that may loop forever, eat all memory, print gigabytes or
read the API keys in your environment. `run_python` runs one program in a fresh `python -I` process:

    - its own empty temporary working directory, deleted afterwards;
    - an environment of PATH, LANG and HOME (the temp dir) only: no secrets are inherited;
    - rlimits set before the program starts: address space (memory_mb), CPU seconds, size of files
      written (stdout and stderr go to files, so output_limit_kb also caps what it prints), no core dumps;
    - a wall-clock timeout, after which its whole process group is killed with SIGKILL.

It returns a `SandboxResult` (stdout, stderr, returncode, timed_out, memory_exceeded); it never raises
for anything the program does. It is a seatbelt, not a jail: the program can still read files your user
can read and use the network. For hostile code, run the trainer (or this helper) inside a container or a
VM. Linux only (rlimits; macOS does not enforce RLIMIT_AS).

Using it in a reward (the completion holds a solution, the dataset row holds the tests):

    from forge.tools.sandbox import run_python

    def passes_tests(prompts, completions, tests, **kwargs):
        scores = []
        for completion, test in zip(completions, tests):
            result = run_python(extract_code(completion) + "\\n\\n" + test, timeout=5, memory_mb=512)
            scores.append(1.0 if result.ok else 0.0)
        return scores

Programs are independent, so a reward may run several at once with a ThreadPoolExecutor (the child
is started without a `preexec_fn`, so this is thread-safe). Keep GRPOConfig.reward_timeout above the
total time the reward may spend.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxResult", "run_python"]

# Runs first in the child: set the limits, then replace itself with the interpreter running the program
# (limits survive exec). Doing it here rather than in a preexec_fn keeps run_python safe from any thread.
_LIMIT_AND_EXEC = """
import os, resource, sys
memory, cpu_seconds, file_bytes = (int(a) for a in sys.argv[1:4])
limits = [(resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_CORE, 0)]
if memory > 0:
    limits.append((resource.RLIMIT_AS, memory))
for kind, value in limits:
    resource.setrlimit(kind, (value, value))
os.execv(sys.executable, [sys.executable, "-I", "-B", sys.argv[4]])
"""


@dataclass
class SandboxResult:
    """What happened to one program."""

    stdout: str  # at most output_limit_kb, decoded as UTF-8 (invalid bytes replaced)
    stderr: str
    returncode: int | None  # exit status; negative = killed by that signal; None only if it could not start
    timed_out: bool  # killed because it ran past the wall-clock timeout
    memory_exceeded: bool  # it died of MemoryError (the address-space limit)
    seconds: float  # wall-clock time it ran

    @property
    def ok(self) -> bool:
        """Exited normally with status 0."""
        return self.returncode == 0 and not self.timed_out


def run_python(
    code: str,
    *,
    timeout: float = 10.0,
    memory_mb: int = 512,
    output_limit_kb: int = 1024,
    stdin: str = "",
    python: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python program in a limited child process; see the module docstring.

    timeout:          wall-clock seconds before the process group is killed (CPU time is capped too)
    memory_mb:        address-space limit of the process (0 = none); allocations past it raise MemoryError
    output_limit_kb:  the most stdout (and, separately, stderr) it may write; past it the program is killed
    stdin:            text fed to the program's standard input
    python:           the interpreter to run (default: this one)
    """
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds")
    if memory_mb < 0 or output_limit_kb < 1:
        raise ValueError("memory_mb must be >= 0 and output_limit_kb >= 1")
    interpreter = python or sys.executable
    with tempfile.TemporaryDirectory(prefix="forge-sandbox-") as workdir:
        work = Path(workdir)
        program = work / "main.py"
        program.write_text(code, encoding="utf-8")
        environment = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": workdir, "PYTHONIOENCODING": "utf-8",
                       "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        limits = [str(memory_mb * 2**20), str(int(timeout) + 1), str(output_limit_kb * 1024)]
        started = time.monotonic()
        with (work / "stdout").open("wb") as out, (work / "stderr").open("wb") as err:
            try:
                process = subprocess.Popen(
                    [interpreter, "-I", "-c", _LIMIT_AND_EXEC, *limits, str(program)],
                    stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir, env=environment,
                    start_new_session=True, close_fds=True)
            except OSError as error:
                return SandboxResult("", f"could not start {interpreter}: {error}", None, False, False, 0.0)
            timed_out = False
            try:
                process.communicate(stdin.encode("utf-8"), timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process.pid)  # the program and anything it started
                process.wait()
        seconds = time.monotonic() - started
        stdout, stderr = (_read(work / name, output_limit_kb) for name in ("stdout", "stderr"))
    memory_exceeded = "MemoryError" in stderr[-2000:]
    return SandboxResult(stdout, stderr, process.returncode, timed_out, memory_exceeded, seconds)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _read(path: Path, limit_kb: int) -> str:
    with path.open("rb") as f:
        return f.read(limit_kb * 1024).decode("utf-8", errors="replace")
