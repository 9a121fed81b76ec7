"""Run untrusted Python (e.g. code a model wrote) in a sandbox built on Linux namespaces, with time, memory,
process and output limits.

A code-execution reward must run programs that may loop forever, eat all memory, fork without end, print
gigabytes, read the API keys in your environment or attack the trainer. `run_python` runs one program under
`unshare` (util-linux) in new user, PID, mount, network, IPC and UTS namespaces, whose first process
(forge/tools/sandbox_init.py) sets the sandbox up, runs the program and takes it down. It needs Linux >= 5.12
and no privileges where the kernel lets users create user namespaces (most Linux distributions; not inside a
default Docker container, and Ubuntu >= 24.04 restricts it through AppArmor).

What it stops:
    - seeing or signalling any process outside: a private PID namespace with its own /proc, so the trainer's
      /proc/<pid>/environ (HF_TOKEN, API keys) cannot be read, and kill() reaches no process outside;
    - outliving the call: when the program exits, or at the timeout, the namespace's first process dies and
      the kernel kills every process in the namespace, setsid() or daemonised or not;
    - the network: a network namespace with nothing in it (not even a loopback that is up); abstract Unix
      sockets belong to the network namespace, so they are out of reach too;
    - writing files: every mount is read-only (and capabilities are dropped, so it stays so); the program's
      working directory, HOME and TMPDIR are a private tmpfs on /tmp; /dev/shm is another; both are counted as
      its memory and vanish with it; /run is replaced by an empty read-only directory;
    - reading well-known credential files (`hide`, default DEFAULT_HIDDEN: ~/.ssh, ~/.aws, ~/.netrc, the
      Hugging Face token, ...): they appear empty;
    - fork bombs: at most `max_processes` processes and threads (RLIMIT_NPROC in its user namespace; the
      kernel exempts the real root user from it, so there a watchdog polling every 10 ms kills the whole
      program past the limit, and on Linux >= 6.14 the namespace's pid_max is a hard ceiling of 300 +
      max_processes);
    - memory: `memory_mb` for the whole program, all its processes and its tmpfs files together (a watchdog
      polling every 10 ms kills them all past it; each process is also capped by RLIMIT_AS, so one allocation
      past it fails at once with MemoryError), and the kernel's OOM killer prefers the sandbox to the trainer;
    - CPU time (RLIMIT_CPU), file size and output (RLIMIT_FSIZE, output_limit_kb), core dumps; a clean
      environment (PATH, LANG, HOME only: no secrets are inherited).

What it does not stop:
    - reading any file your user can read (read-only) that is not hidden: your code, data sets, and (when
      Forge runs as root) root's files; hide more with `hide=`;
    - Unix sockets on the filesystem outside /tmp and /run (connect() needs no write access): a Docker or
      X11 socket elsewhere stays reachable;
    - kernel exploits: the namespaces share the host kernel; CPU time of other cores within the timeout;
    - the memory watchdog polls: an allocation burst between two polls can exceed memory_mb for up to 10 ms
      (by at most memory_mb per process, the RLIMIT_AS).
For code that may be actively hostile beyond that, run the trainer (or this helper) inside a VM.

The sandbox fails closed: where it cannot be set up (user namespaces unavailable, a mount refused, the
interpreter not found inside) `run_python` raises RuntimeError with the cause, and runs nothing. The
interpreter is found through symlinks (a virtualenv reached as /tmp/x/venv -> /tmp/y/.venv runs as
/tmp/y/.venv/bin/python), and whatever of it lives under /tmp (its prefix, base prefix and import path) is
bound back, read-only, inside. Running unisolated takes an explicit opt-in: `namespaces=False` never uses
namespaces; `allow_unisolated=True` uses them when they can be set up and otherwise warns (once) and falls
back. The fallback runs the program with rlimits in a plain child process that is a child subreaper (its
daemonised descendants are still found and killed, and the watchdog still counts processes and memory): then
the program CAN read your processes' /proc/<pid>/environ, signal them, use the network and write your files.
`SandboxResult.isolated` says which ran. Linux only.

Using it in a reward (the completion holds a solution, the dataset row holds the tests):

    from forge.tools.sandbox import run_python

    def passes_tests(prompts, completions, tests, **kwargs):
        scores = []
        for completion, test in zip(completions, tests):
            result = run_python(extract_code(completion) + "\\n\\n" + test, timeout=5, memory_mb=512)
            scores.append(1.0 if result.ok else 0.0)
        return scores

Programs are independent, so a reward may run several at once with a ThreadPoolExecutor (nothing here uses a
`preexec_fn`, so this is thread-safe). Keep GRPOConfig.reward_timeout above the total time
the reward may spend.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from forge.tools.outcome import readable

__all__ = ["DEFAULT_HIDDEN", "SandboxResult", "namespace_problem", "run_python"]

INIT = str(Path(__file__).with_name("sandbox_init.py"))
NAMESPACES = [
    "--user",
    "--map-root-user",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount",
    "--mount-proc",
    "--net",
    "--ipc",
    "--uts",
]
DEFAULT_HIDDEN = (
    "~/.ssh",
    "~/.aws",
    "~/.azure",
    "~/.config/gcloud",
    "~/.docker",
    "~/.kube",
    "~/.netrc",
    "~/.git-credentials",
    "~/.pypirc",
    "~/.config/gh",
    "~/.huggingface",
    "~/.cache/huggingface/token",
    "~/.cache/huggingface/stored_tokens",
    "$HF_HOME/token",
    "$HF_TOKEN_PATH",
)
_warned = False
NAMESPACE_RETRY_SECONDS = 10.0
_namespace_verdict: tuple[float, str | None] | None = None  # (when tried, the problem or None)


@dataclass
class SandboxResult:
    """What happened to one program."""

    stdout: str  # at most output_limit_kb, decoded as UTF-8 (invalid bytes replaced)
    stderr: str
    returncode: int | None  # exit status; negative = killed by that signal; None only if it could not start
    timed_out: bool  # killed because it ran past the wall-clock timeout
    memory_exceeded: bool  # it died of MemoryError, or all of it was killed past memory_mb together
    seconds: float  # wall-clock time it ran
    processes_exceeded: bool = False  # all of it was killed for running more than max_processes at once
    isolated: bool = False  # it ran in namespaces (False: the rlimits-only fallback)

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
    max_processes: int = 64,
    hide: Sequence[str] = DEFAULT_HIDDEN,
    namespaces: bool = True,
    allow_unisolated: bool = False,
) -> SandboxResult:
    """Run `code` as a Python program in the sandbox; see the module docstring. Never raises for anything the
    program does; raises RuntimeError, having run nothing, when the sandbox cannot isolate it (the cause
    said), unless `allow_unisolated` or `namespaces=False` opts in to running it unisolated.

    timeout:          wall-clock seconds before the whole program is killed (CPU time is capped too)
    memory_mb:        memory of the whole program (0 = none); also each process's address-space limit
    output_limit_kb:  the most stdout (and, separately, stderr) it may write, and the largest file it may
                      write
    stdin:            text fed to the program's standard input (a lone surrogate in it or in `code` is U+FFFD)
    python:           the interpreter to run (default: this one)
    max_processes:    processes and threads it may run at once
    hide:             files and directories that appear empty to it ('~' and '$VAR' are expanded)
    namespaces:       False: run it with rlimits only, NOT isolated (no namespaces are tried)
    allow_unisolated: where the namespaces cannot be set up, warn and run it with rlimits only, instead of
                      raising RuntimeError
    """
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds")
    if memory_mb < 0 or output_limit_kb < 1 or max_processes < 1:
        raise ValueError("memory_mb must be >= 0, output_limit_kb >= 1 and max_processes >= 1")
    code, stdin = readable(code), readable(stdin)
    interpreter = os.path.abspath(python or sys.executable)
    if not (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
        return SandboxResult("", f"could not start {interpreter}: not an executable file", None, False, False,
                             0.0)
    limits = {
        "memory": memory_mb * 2**20,
        "cpu_seconds": int(timeout) + 1,
        "file_bytes": output_limit_kb * 1024,
        "max_processes": max_processes,
        "hide": _expand(hide),
    }
    if namespaces is False:
        return _run(code, stdin, timeout, {**limits, "interpreter": interpreter, "keep": []}, output_limit_kb,
                    namespace=False)
    problem = namespace_problem()
    if problem is None:
        try:
            return _run(code, stdin, timeout, {**limits, **_visible_inside(interpreter)}, output_limit_kb,
                        namespace=True)
        except SetupError as error:
            problem = str(error)
    if not allow_unisolated:
        raise _cannot_isolate(problem)
    _warn_once(problem)
    return _run(code, stdin, timeout, {**limits, "interpreter": interpreter, "keep": []}, output_limit_kb,
                namespace=False)


def _cannot_isolate(problem: str) -> RuntimeError:
    """The error of run_python when the namespaces cannot be set up and running unisolated was not asked
    for: the cause, how to fix it, and how to opt in."""
    return RuntimeError(
        f"run_python: cannot isolate the program, so it was not run ({problem}). Fix the cause; where "
        "Linux user namespaces are off, allow them (sysctl kernel.unprivileged_userns_clone=1; on "
        "Ubuntu also kernel.apparmor_restrict_unprivileged_userns=0) or run the trainer in a VM. To run "
        "programs NOT isolated (they can read your processes' secrets, use the network and write your "
        "files), pass allow_unisolated=True, or namespaces=False."
    )


class SetupError(RuntimeError):
    """The namespace sandbox could not be set up for a program (it was not run)."""


def namespace_problem() -> str | None:
    """None when the sandbox's namespaces work here, else why not. Tried with an empty program: a success is
    remembered for the process; a failure only for NAMESPACE_RETRY_SECONDS, then tried again, so a passing
    cause (the user namespace limit reached for a moment by other programs) does not refuse every later
    call."""
    global _namespace_verdict
    if _namespace_verdict is not None:
        tried_at, problem = _namespace_verdict
        if problem is None or time.monotonic() - tried_at < NAMESPACE_RETRY_SECONDS:
            return problem
    problem = _try_namespaces()
    _namespace_verdict = (time.monotonic(), problem)
    return problem


def _try_namespaces() -> str | None:
    if sys.platform != "linux":
        return f"{sys.platform} is not Linux"
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    limits = {**_visible_inside(os.path.abspath(sys.executable)), "memory": 256 * 2**20, "cpu_seconds": 30,
              "file_bytes": 2**16, "max_processes": 8, "hide": []}
    try:
        result = _run("pass", "", 30.0, limits, 64, namespace=True)
    except SetupError as error:
        return str(error)
    if result.ok:
        return None
    return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]


@functools.lru_cache(maxsize=16)
def _visible_inside(interpreter: str) -> dict:
    """How a namespace sandbox reaches `interpreter`: the path to run it by, with every directory on the way
    resolved (inside, /tmp is a fresh tmpfs, so a symlink there leads nowhere; the file itself stays as named,
    so a virtualenv's python still finds its pyvenv.cfg), and the directories under /tmp to bind back
    read-only: each hop of its symlinks, its prefix, base prefix and import path."""
    hops = [os.path.join(os.path.realpath(os.path.dirname(interpreter)), os.path.basename(interpreter))]
    while os.path.islink(hops[-1]) and len(hops) < 40:
        target = os.path.join(os.path.dirname(hops[-1]), os.readlink(hops[-1]))
        hops.append(os.path.join(os.path.realpath(os.path.dirname(target)), os.path.basename(target)))
    needed = [os.path.dirname(os.path.dirname(hop)) for hop in hops]
    try:
        question = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, *sys.path]))"
        found = subprocess.run(
            [interpreter, "-I", "-c", question], capture_output=True, text=True, timeout=60, check=False
        )
        needed += json.loads(found.stdout) if found.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass  # it is found inside or not; the sandbox then says which
    real = {os.path.realpath(path) for path in needed if path and os.path.exists(path)}
    folders = {path if os.path.isdir(path) else os.path.dirname(path) for path in real}
    under_tmp = sorted(path for path in folders if path.startswith("/tmp/"))
    keep = [path for path in under_tmp if not any(path.startswith(other + os.sep) for other in under_tmp)]
    return {"interpreter": hops[0], "keep": keep}


def _warn_once(problem: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"forge.tools.sandbox: the sandbox cannot isolate programs here ({problem}), so "
            "run_python(allow_unisolated=True) runs them NOT ISOLATED, with rlimits only: a program can "
            "read your processes' secrets (/proc/<pid>/environ), signal them, use the network and write "
            "your files. Where Linux user namespaces are off, allow them (sysctl "
            "kernel.unprivileged_userns_clone=1; on Ubuntu also "
            "kernel.apparmor_restrict_unprivileged_userns=0), or run the trainer in a VM.",
            RuntimeWarning,
            stacklevel=3,
        )


def _expand(paths: Sequence[str]) -> list[str]:
    expanded = (os.path.expanduser(os.path.expandvars(p)) for p in paths)
    return sorted({os.path.abspath(p) for p in expanded if "$" not in p and os.path.lexists(p)})


def _run(code: str, stdin: str, timeout: float, limits: dict, output_limit_kb: int,
         namespace: bool) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="forge-sandbox-") as workdir:
        work = Path(workdir)
        (work / "main.py").write_text(code, encoding="utf-8")
        inside = f"/tmp/{work.name}" if namespace else workdir
        environment = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": inside, "TMPDIR": inside,
                       "PYTHONIOENCODING": "utf-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        with (work / "status").open("wb") as status:
            config = {**limits, "program": str(work / "main.py"), "workdir": workdir, "name": work.name,
                      "namespace": namespace, "environment": environment, "status_fd": status.fileno()}
            command = [sys.executable, "-I", "-S", "-B", INIT, json.dumps(config)]
            if namespace:
                command = [shutil.which("unshare") or "unshare", *NAMESPACES, "--", *command]
            started = time.monotonic()
            with (work / "stdout").open("wb") as out, (work / "stderr").open("wb") as err:
                try:
                    process = subprocess.Popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=out,
                        stderr=err,
                        cwd=workdir,
                        env=environment,
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(status.fileno(),),
                    )
                except OSError as error:
                    if namespace:
                        raise SetupError(f"could not start unshare: {error}") from error
                    return SandboxResult("", f"could not start the sandbox: {error}", None, False, False, 0.0)
                timed_out = False
                try:
                    process.communicate(stdin.encode("utf-8"), timeout=timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _stop(process, namespace)
        seconds = time.monotonic() - started
        stdout, stderr = (_read(work / name, output_limit_kb) for name in ("stdout", "stderr"))
        try:
            outcome = json.loads((work / "status").read_text() or "{}")
        except ValueError:
            outcome = {}
    if namespace and not timed_out and outcome.get("returncode") is None:  # the program never ran
        said = " ".join(line.strip() for line in stderr.strip().splitlines()[-3:])
        raise SetupError(outcome.get("setup_error") or said or f"the sandbox exited {process.returncode}")
    if outcome.get("setup_error"):
        stderr = f"{stderr}sandbox: {outcome['setup_error']}\n"
    returncode = -signal.SIGKILL if timed_out else outcome.get("returncode", process.returncode)
    memory_exceeded = bool(outcome.get("memory_exceeded")) or "MemoryError" in stderr[-2000:]
    return SandboxResult(stdout, stderr, returncode, timed_out, memory_exceeded, seconds,
                         bool(outcome.get("processes_exceeded")), namespace)


def _stop(process: subprocess.Popen, namespace: bool) -> None:
    """Kill the whole program at its timeout; returns once nothing of it runs."""
    init = _children(process.pid) if namespace else [process.pid]
    if not namespace:  # the init kills its descendants, daemonised ones too, then exits
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # unshare and the namespace's init: the kernel kills the rest
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in init) and time.monotonic() < deadline:  # the namespace is being emptied
        time.sleep(0.01)


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _read(path: Path, limit_kb: int) -> str:
    with path.open("rb") as f:
        return f.read(limit_kb * 1024).decode("utf-8", errors="replace")
