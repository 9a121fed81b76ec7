"""The first process of a sandbox (forge/tools/sandbox.py): it sets the sandbox up, starts the program,
watches it, and takes every process the program started down with it. Run as a script (`python -I -S -B
sandbox_init.py CONFIG_JSON`); it imports only the standard library.

In a namespace sandbox it is PID 1 of the new PID namespace, root of the new user namespace (mapped to the
caller's own user) and alone in new mount, network, IPC and UTS namespaces:
    1. it makes every mount read-only (mount_setattr, recursively), then mounts a private, size-limited tmpfs
       on /tmp (the program's working directory lives there; a Python installed under /tmp is bound back,
       read-only) and on /dev/shm, an empty read-only tmpfs on /run, and hides the credential paths it is
       given (an empty read-only tmpfs on a directory, /dev/null on a file);
    2. it caps the namespace's PIDs (pid_max, kernels >= 6.14) and starts the program with its rlimits, all
       capabilities dropped and no_new_privs set, so the program cannot undo any of the above;
    3. until the program exits it reaps orphans and polls every process in the namespace: more than
       `max_processes` of them, or more than `memory` bytes together (resident memory, counted once per page
       with PSS, plus what the tmpfs mounts hold), kills them all;
    4. when the program exits it kills what is left, writes the outcome as JSON to the status fd, and exits,
       which makes the kernel kill anything still in the namespace.
Without namespaces (the fallback) it only does 2 (rlimits) and 3 for its own descendants, as a child
subreaper, so that a program's daemonised grandchildren are still found and killed.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

POLL_SECONDS = 0.01  # how often the whole program's processes and memory are counted

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 0x1, 0x2, 0x4, 0x1000, 0x4000
_AT_RECURSIVE, _MOUNT_ATTR_RDONLY, _SYS_MOUNT_SETATTR = 0x8000, 0x1, 442  # 442 on every Linux architecture
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    """The sandbox could not be set up (the caller then treats namespaces as unavailable)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> None:
    encode = (lambda text: None if text is None else text.encode())
    _check(_libc.mount(encode(source), encode(target), encode(kind), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _everything_read_only() -> None:
    # struct mount_attr: set, clear, propagation, userns
    attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(_libc.syscall(_SYS_MOUNT_SETATTR, -100, b"/", _AT_RECURSIVE, attr, ctypes.sizeof(attr)),
           "mount_setattr(/, read-only, recursive)")


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def set_up_namespace(config: dict, program: bytes) -> str:
    """Steps 1 and 2's pid_max (module docstring); returns the program's working directory."""
    _write("/proc/self/oom_score_adj", "1000")  # under memory pressure the kernel picks the sandbox first
    _write("/proc/sys/kernel/pid_max", str(300 + config["max_processes"]))  # >= 6.14: a hard ceiling
    _everything_read_only()
    # A Python installed under /tmp (a virtualenv in a CI checkout, say) stays visible, read-only, through the
    # private /tmp: the folders the caller found it needs (`keep`) are held open before the tmpfs covers them,
    # and bound back onto the same paths after.
    kept = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in config["keep"]}
    scratch = f"size={config['memory'] // 1024}k,mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, scratch)
    for path, fd in kept.items():
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)
    for path, data in (("/dev/shm", scratch), ("/run", "size=4k,mode=755")):
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if path == "/run" else 0),
                   data)
    for path in config["hide"]:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k,mode=755")
        elif os.path.exists(path):
            _mount("/dev/null", path, None, _MS_BIND)
    if not os.access(config["interpreter"], os.X_OK):
        raise SetupError(
            f"the interpreter {config['interpreter']} is not there, or not executable, inside the sandbox"
        )
    workdir = os.path.join("/tmp", config["name"])
    os.mkdir(workdir)
    with open(os.path.join(workdir, "main.py"), "wb") as f:
        f.write(program)
    return workdir


def _drop_privileges() -> None:
    """No capability can come back: bounding, ambient, permitted, effective and inheritable sets emptied."""
    cap = 0
    while _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # fails past the kernel's last capability
        cap += 1
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _start_program(config: dict, workdir: str, status_fd: int) -> tuple[int, str | None]:
    """Fork and exec the program; its pid, and why it could not be started (None once it runs)."""
    errors_out, errors_in = os.pipe()  # close-on-exec: EOF once the program runs, the reason if it cannot
    pid = os.fork()
    if pid:
        os.close(errors_in)
        with os.fdopen(errors_out, "rb") as errors:
            reason = errors.read().decode(errors="replace")
        return pid, reason or None
    try:  # the child: limits, no privileges, then the program
        os.close(status_fd)
        os.close(errors_out)
        limits = [(resource.RLIMIT_CPU, config["cpu_seconds"]), (resource.RLIMIT_FSIZE, config["file_bytes"]),
                  (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, config["nproc"])]
        if config["memory"] > 0:
            limits.append((resource.RLIMIT_AS, config["memory"]))
        for kind, value in limits:
            resource.setrlimit(kind, (value, value))
        if config["namespace"]:
            _drop_privileges()
        os.chdir(workdir)
        program = config["interpreter"]
        os.execve(program, [program, "-I", "-B", "main.py"], config["environment"])
    except BaseException as error:  # noqa: BLE001 - the child must never return into the init's code
        os.write(errors_in, f"could not start the program: {error}".encode())
    os._exit(127)


def _processes() -> list[int]:
    """Every process of the sandbox but this one: the namespace's (as PID 1), else this process's
    descendants."""
    if os.getpid() == 1:
        return [int(name) for name in os.listdir("/proc") if name.isdigit() and name != "1"]
    found, frontier = [], [os.getpid()]
    while frontier:
        pid = frontier.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    frontier += [int(child) for child in f.read().split()]
        except OSError:
            continue
        found += [] if pid == os.getpid() else [pid]
    return found


def _over_memory(processes: list[int], scratch: list[str], limit: int) -> bool:
    """Whether the program holds more than `limit` bytes: the tmpfs mounts' contents plus resident anonymous
    memory (a quick upper bound), confirmed with PSS (a page shared after fork counts once)
    when it is over."""
    held = 0
    for path in scratch:
        stat = os.statvfs(path)
        held += stat.f_frsize * (stat.f_blocks - stat.f_bfree)
    quick, page = held, resource.getpagesize()
    for pid in processes:
        try:
            with open(f"/proc/{pid}/statm") as f:
                fields = f.read().split()
            quick += (int(fields[1]) - int(fields[2])) * page
        except (OSError, IndexError, ValueError):
            continue
    if limit <= 0 or quick <= limit:
        return False
    proportional = held
    for pid in processes:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                proportional += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration, ValueError):
            continue
    return proportional > limit


def _user_tasks() -> int:
    """Tasks (processes and threads) of this user on the machine: RLIMIT_NPROC counts them all without a user
    namespace."""
    uid, count = str(os.getuid()), 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            count += int(fields["Threads"]) if fields["Uid"].split()[0] == uid else 0
        except (OSError, KeyError, ValueError):
            continue
    return count


def _kill_all() -> None:
    if os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)  # from a namespace's init: every other process of the namespace
        except ProcessLookupError:
            pass  # none left
        return
    for _ in range(20):  # descendants may fork while they are being killed
        processes = _processes()
        if not processes:
            return
        for pid in processes:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap()


def _reap(main: int | None = None) -> int | None:
    """Reap every exited child (orphans are ours); the wait status of `main` when it was among them."""
    status = None
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == main:
            status = code


def _on_timeout(*_) -> None:  # the caller's SIGTERM at its timeout (fallback; a namespace init gets SIGKILL)
    _kill_all()
    os._exit(137)


def main() -> None:
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    outcome = {"returncode": None, "memory_exceeded": False, "processes_exceeded": False, "setup_error": None}
    try:
        with open(config["program"], "rb") as f:
            program = f.read()
        if config["namespace"]:
            workdir = set_up_namespace(config, program)
            config["nproc"] = config["max_processes"] + 1  # counted in this user namespace: the sandbox only
        else:
            workdir = config["workdir"]
            _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphaned descendants come back to this process
            config["nproc"] = _user_tasks() + config["max_processes"] + 1
    except (SetupError, OSError) as error:
        outcome["setup_error"] = str(error)
        os.write(status_fd, json.dumps(outcome).encode())
        sys.exit(125)
    scratch = ["/tmp", "/dev/shm"] if config["namespace"] else []
    signal.signal(signal.SIGTERM, _on_timeout)
    child, reason = _start_program(config, workdir, status_fd)
    if reason is not None:
        os.waitpid(child, 0)
        outcome["setup_error"] = reason
        os.write(status_fd, json.dumps(outcome).encode())
        sys.exit(125)
    try:
        waiter = os.pidfd_open(child)  # readable when the program exits
    except (AttributeError, OSError):
        waiter = None
    status = None
    while status is None:
        if waiter is not None:
            select.select([waiter], [], [], POLL_SECONDS)
        else:
            time.sleep(POLL_SECONDS)
        status = _reap(child)
        if status is not None:
            break
        processes = _processes()
        if len(processes) > config["max_processes"]:
            outcome["processes_exceeded"] = True
        elif _over_memory(processes, scratch, config["memory"]):
            outcome["memory_exceeded"] = True
        else:
            continue
        _kill_all()
        status = signal.SIGKILL  # the wait status of a process killed by SIGKILL
    _kill_all()
    outcome["returncode"] = os.waitstatus_to_exitcode(status)
    os.write(status_fd, json.dumps(outcome).encode())


if __name__ == "__main__":
    main()
