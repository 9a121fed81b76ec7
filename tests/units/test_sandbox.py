"""The sandbox as a boundary: each escape a program tried against forge.tools.sandbox.run_python, and the
fallback without namespaces (loud, and still killing daemonised grandchildren).

Escapes: reading the trainer's secrets through /proc/<pid>/environ, killing the trainer, a setsid() grandchild
outliving the timeout, a fork bomb, memory spread over several processes, the network, writing files, undoing
the read-only mounts, reading a credential file. The namespace tests are skipped where Linux namespaces are
unavailable (namespace_problem() says why).
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from forge.tools import sandbox
from forge.tools.sandbox import namespace_problem, run_python

needs_namespaces = pytest.mark.skipif(namespace_problem() is not None,
                                      reason=f"Linux namespaces unavailable: {namespace_problem()}")


def program(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


def processes_with(marker: str) -> list[int]:
    """Live processes anywhere on the machine whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def in_a_trainer(code: str, **environment) -> subprocess.CompletedProcess:
    """Run `code` in the sandbox from a fresh "trainer" process started with `environment` (what
    /proc/<pid>/environ shows is the environment a process was started with); TRAINER_PID in `code` is that
    trainer's pid. The trainer prints 'trainer survived', then the program's stdout."""
    trainer = program(f"""
        import os, sys
        sys.path[:0] = {sys.path!r}
        from forge.tools.sandbox import run_python
        result = run_python({code!r}.replace("TRAINER_PID", str(os.getpid())))
        print("trainer survived", result.returncode, result.isolated)
        print(result.stdout)
    """)
    return subprocess.run([sys.executable, "-c", trainer], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **environment})


@needs_namespaces
def test_the_trainers_environment_cannot_be_read_through_proc():
    done = in_a_trainer(program("""
        import os
        for pid in ["TRAINER_PID", str(os.getppid())] + os.listdir("/proc"):
            try:
                print(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
            except OSError:
                pass
        print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    """), HF_TOKEN="hf_planted_secret_4412")
    assert done.returncode == 0 and "trainer survived 0 True" in done.stdout, (done.stdout, done.stderr)
    assert "hf_planted_secret_4412" not in done.stdout
    assert "pids [1, 2]" in done.stdout  # its init and itself, nothing else


@needs_namespaces
def test_the_program_cannot_kill_the_process_that_runs_it():
    done = in_a_trainer(program("""
        import os, signal
        for pid in (TRAINER_PID, os.getppid(), 1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as error:
                print(pid, error)
    """))
    assert done.returncode == 0 and "trainer survived 0 True" in done.stdout, (done.stdout, done.stderr)


@needs_namespaces
def test_a_setsid_grandchild_dies_with_the_program_at_the_timeout():
    marker = f"forge-marker-{uuid.uuid4().hex}"
    result = run_python(program(f"""
        import os, subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(30)", "{marker}"],
                         start_new_session=True)
        if os.fork() == 0:  # the classic daemon: fork, setsid, fork again, parent exits
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", "{marker}"])
            os._exit(0)
        while True:
            pass
    """), timeout=2)
    assert result.timed_out and result.returncode == -signal.SIGKILL
    assert processes_with(marker) == []  # at once: run_python returns when the namespace is empty


@needs_namespaces
def test_a_fork_bomb_is_held_to_max_processes():
    started = time.perf_counter()
    result = run_python(program("""
        import os, time
        made = 0
        try:
            while made < 2000:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                made += 1
        except OSError as error:
            print("refused after", made, error)
            os._exit(0)
        print("forked", made)
    """), timeout=30, max_processes=32)
    assert "forked 2000" not in result.stdout
    refused = result.stdout.startswith("refused after") and int(result.stdout.split()[2]) <= 32
    assert refused or result.processes_exceeded, result  # fork fails (RLIMIT_NPROC) or the watchdog kills all
    assert time.perf_counter() - started < 25


FOUR_CHILDREN_OF_60_MB = program("""
    import os, time
    for _ in range(4):
        if os.fork() == 0:
            block = b"x" * (60 * 2**20)
            time.sleep(30)
            os._exit(0)
    time.sleep(30)
    print("all allocated")
""")


@needs_namespaces
def test_memory_is_counted_for_the_whole_program():
    # 4 children of 60 MB each: every process stays under its own 128 MB, the program does not
    result = run_python(FOUR_CHILDREN_OF_60_MB, memory_mb=128, timeout=20)
    assert result.memory_exceeded and not result.timed_out and "all allocated" not in result.stdout, result
    assert result.returncode == -signal.SIGKILL


@needs_namespaces
def test_files_in_the_temp_dir_count_as_memory():
    result = run_python(program("""
        with open("big", "wb") as f:
            for _ in range(100):
                f.write(b"x" * 2**20)
                f.flush()
        import time
        time.sleep(30)
    """), memory_mb=64, output_limit_kb=128 * 1024, timeout=20)
    assert not result.ok and not result.timed_out
    assert result.memory_exceeded or "No space left" in result.stderr, result


@needs_namespaces
def test_there_is_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        result = run_python(program(f"""
            import socket
            for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
                try:
                    socket.create_connection(address, timeout=2)
                    print("connected", address)
                except OSError as error:
                    print("refused", error)
        """))
    finally:
        listener.close()
    assert result.ok and "connected" not in result.stdout and result.stdout.count("refused") == 2


@needs_namespaces
def test_only_its_temp_dir_is_writable_and_the_mounts_stay_read_only(tmp_path):
    target = tmp_path / "written_by_the_sandbox"  # under /tmp, which is its own tmpfs in there
    beside_tests = Path(__file__).with_name("written_by_the_sandbox")
    result = run_python(program(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        print("remount", libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None),
              libc.umount2(b"/tmp", 2), libc.unshare(0x00020000))
        for path in [{str(target)!r}, {os.path.expanduser("~/forge_sandbox_escape")!r}, {str(beside_tests)!r}]:
            try:
                open(path, "w").write("escaped")
                print("wrote", path)
            except OSError as error:
                print("refused", error.errno)
        open("mine.txt", "w").write("fine")
        print("own dir", open("mine.txt").read(), os.getcwd() == os.environ["HOME"] == os.environ["TMPDIR"])
    """))
    assert result.ok, result.stderr
    assert "remount -1 -1 -1" in result.stdout  # no capability to remount, unmount or make a mount namespace
    assert "wrote" not in result.stdout and not target.exists()
    assert not Path(os.path.expanduser("~/forge_sandbox_escape")).exists() and not beside_tests.exists()
    assert result.stdout.count("refused ") == 3 and "refused 30" in result.stdout  # EROFS: read-only file system
    # (the checkout's own folder reads as absent instead when it lies under /tmp, hidden by the private /tmp)
    assert "own dir fine True" in result.stdout


@needs_namespaces
def test_credential_files_appear_empty(monkeypatch):
    with tempfile.TemporaryDirectory(dir=os.path.expanduser("~"), prefix=".forge-test-home-") as where:
        home = Path(where)  # not under /tmp, which is the sandbox's own tmpfs
        (home / ".cache" / "huggingface").mkdir(parents=True)
        (home / ".cache" / "huggingface" / "token").write_text("hf_file_secret_9931")
        (home / ".ssh").mkdir()
        (home / ".ssh" / "id_ed25519").write_text("ssh_secret_2210")
        monkeypatch.setenv("HOME", str(home))
        result = run_python(program(f"""
            import os
            print(repr(open({str(home / '.cache/huggingface/token')!r}).read()))
            print(os.listdir({str(home / '.ssh')!r}))
        """))
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["''", "[]"]


# ----------------------------------------------------------------------------------------------------
# without namespaces


def test_without_namespaces_a_daemonised_grandchild_is_still_killed():
    marker = f"forge-marker-{uuid.uuid4().hex}"
    result = run_python(program(f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(30)", "{marker}"],
                         start_new_session=True)
        while True:
            pass
    """), timeout=2, namespaces=False)
    assert result.timed_out and not result.isolated
    assert processes_with(marker) == []


def test_without_namespaces_memory_is_still_counted_for_the_whole_program():
    result = run_python(FOUR_CHILDREN_OF_60_MB, memory_mb=128, timeout=20, namespaces=False)
    assert result.memory_exceeded and not result.timed_out, result


@needs_namespaces
def test_a_python_installed_under_tmp_stays_usable_and_read_only():
    home = os.path.realpath(sys.prefix)
    result = run_python(program(f"""
        import os, sys
        print("prefix", os.path.realpath(sys.prefix) == {home!r}, os.path.isdir({home!r}))
        try:
            open(os.path.join({home!r}, "written_by_the_sandbox"), "w").write("escaped")
            print("wrote")
        except OSError as error:
            print("refused", error.errno)
    """))
    assert result.ok, result.stderr
    assert "prefix True True" in result.stdout and "wrote" not in result.stdout
    assert not os.path.exists(os.path.join(home, "written_by_the_sandbox"))


# ----------------------------------------------------------------------------------------------------
# failing closed: an interpreter the sandbox must find through symlinks, and isolation that cannot be set up

READ_EVERY_ENVIRON = program("""
    import os
    for pid in os.listdir("/proc"):
        try:
            print(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
        except OSError:
            pass
""")


def venv_under_tmp() -> Path:
    """A virtualenv of this Python in a fresh directory under /tmp (what a CI checkout often has)."""
    home = Path(tempfile.mkdtemp(prefix="forge-test-venv-", dir="/tmp"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / ".venv")], check=True, timeout=120)
    return home / ".venv"


def trainer_started_from(python: str, code: str, **environment) -> subprocess.CompletedProcess:
    """`in_a_trainer`, with the trainer started from the interpreter `python`."""
    trainer = program(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        from forge.tools.sandbox import run_python
        result = run_python({code!r})
        print("trainer survived", result.returncode, result.isolated)
        print(result.stdout)
    """)
    return subprocess.run([python, "-c", trainer], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **environment})


@needs_namespaces
def test_a_trainer_in_a_venv_under_tmp_runs_programs_isolated():
    venv = venv_under_tmp()
    try:
        done = trainer_started_from(str(venv / "bin" / "python"), READ_EVERY_ENVIRON, HF_TOKEN="hf_planted_5521")
        assert "trainer survived 0 True" in done.stdout, (done.stdout, done.stderr)
        assert "hf_planted_5521" not in done.stdout and "Warning" not in done.stderr
    finally:
        shutil.rmtree(venv.parent)


@needs_namespaces
def test_a_trainer_reached_through_a_symlinked_venv_runs_programs_isolated():
    venv = venv_under_tmp()  # /tmp/<a>/.venv, reached as /tmp/<b>/venv
    link_home = Path(tempfile.mkdtemp(prefix="forge-test-link-", dir="/tmp"))
    (link_home / "venv").symlink_to(venv)
    try:
        done = trainer_started_from(str(link_home / "venv" / "bin" / "python"), READ_EVERY_ENVIRON,
                                    HF_TOKEN="hf_planted_5522")
        assert "trainer survived 0 True" in done.stdout, (done.stdout, done.stderr)
        assert "hf_planted_5522" not in done.stdout and "Warning" not in done.stderr
        # the same interpreter handed over explicitly, from this process
        result = run_python("import sys\nprint(sys.prefix)", python=str(link_home / "venv" / "bin" / "python"))
        assert result.ok and result.isolated and result.stdout.strip() == str(venv), result
    finally:
        shutil.rmtree(link_home)
        shutil.rmtree(venv.parent)


def test_when_namespaces_are_unavailable_it_refuses_and_says_why(monkeypatch):
    monkeypatch.setattr(sandbox, "namespace_problem", lambda: "user namespaces are disabled")
    with pytest.raises(RuntimeError, match=r"cannot isolate.*\(user namespaces are disabled\).*allow_unisolated"):
        run_python("print('ran')")


@needs_namespaces
def test_when_the_sandbox_cannot_be_set_up_it_refuses_with_the_real_cause(monkeypatch):
    monkeypatch.setattr(sandbox, "NAMESPACES", [*sandbox.NAMESPACES, "--no-such-option"])
    with pytest.raises(RuntimeError, match=r"cannot isolate.*no-such-option"):
        run_python("print('ran')")


def test_running_unisolated_takes_an_explicit_opt_in(monkeypatch):
    monkeypatch.setattr(sandbox, "namespace_problem", lambda: "user namespaces are disabled")
    monkeypatch.setattr(sandbox, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"\(user namespaces are disabled\).*NOT ISOLATED"):
        result = run_python("print(6 * 7)", allow_unisolated=True)
    assert result.ok and result.stdout == "42\n" and not result.isolated
    chosen = run_python("print(6 * 7)", namespaces=False)  # asked for by name: no isolation, no warning
    assert chosen.ok and not chosen.isolated


@needs_namespaces
def test_a_lone_surrogate_in_the_code_or_stdin_runs_as_u_fffd():
    result = run_python("print('a\udcffb')")
    assert result.ok and result.stdout == "a\ufffdb\n", result
    echoed = run_python("import sys\nprint(sys.stdin.read())", stdin="x\ud800y")
    assert echoed.ok and echoed.stdout == "x\ufffdy\n", echoed


@needs_namespaces
def test_a_passing_namespace_failure_does_not_refuse_the_later_calls(monkeypatch):
    monkeypatch.setattr(sandbox, "_namespace_verdict", None)
    real_run = sandbox._run

    def fails_once(*args, namespace, **kwargs):
        if namespace:
            raise sandbox.SetupError("unshare: user namespace limit reached for a moment")
        return real_run(*args, namespace=namespace, **kwargs)

    monkeypatch.setattr(sandbox, "_run", fails_once)
    with pytest.raises(RuntimeError, match="limit reached for a moment"):
        run_python("print('ran')")
    monkeypatch.setattr(sandbox, "_run", real_run)  # namespaces work again
    with pytest.raises(RuntimeError, match="limit reached for a moment"):  # within the retry window: as said
        run_python("print('ran')")
    monkeypatch.setattr(sandbox, "NAMESPACE_RETRY_SECONDS", 0.0)  # the window has passed
    result = run_python("print('ran')")
    assert result.ok and result.isolated and result.stdout == "ran\n", result
