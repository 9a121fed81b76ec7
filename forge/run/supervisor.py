"""`forge train` watches its training process, so an exit no `except` can catch is still said,
with where to resume.

User code inside a run (a reward, a tool) can end the process in ways Python cannot intercept: `os._exit()`, a
crash of a C extension (SIGSEGV), the kernel's out-of-memory killer (SIGKILL). In one process the run would
just stop, with that process's exit code and no message; `os._exit(0)` even exits 0, which scripts read as
success. So `forge train` forks once its arguments are checked, before any model loads: the child trains, the
parent waits. When the child ends without reaching the end of `forge train` (finished, failed with a message,
or interrupted: each says so itself), the parent prints one line, what ended it and which step is saved for
`--resume`, and exits 1:

    forge: error: the training process exited with code 0 before the run ended (os._exit() in a reward or
    tool ends a process without a word); the last finished step is saved in out/checkpoint-2: continue with
    the same command plus --resume

The child is a copy of the parent (fork, no second interpreter or torch import), so watching costs one fork
(4.5 ms for fork, exit and wait with torch imported, on a 2-core Xeon with AMX-BF16) and a sleeping parent.

Signals: SIGINT, SIGTERM and SIGHUP sent to the parent are passed on to the child, so a stop signal to either
process (`kill -INT`, `timeout -s INT`, a job runner, `Popen.send_signal`) gives the run's documented stop:
finish the step under way, save it, exit 130. The parent passes each on as a real-time signal of its own
(forge.run.signals.relayed_as), so the child counts a signal that reached both processes (Ctrl-C in a
terminal, a signal to the process group) once. Before training starts and after it ends the child takes a
relayed signal as the signal itself. A SIGHUP ignored by `nohup` stays ignored. The child gets SIGKILL when
the parent dies (Linux's PR_SET_PDEATHSIG), so `kill -9` of `forge train` still stops the training at once.

Not watched: the Python API (`GRPOTrainer.train` in a script of yours: nothing outside the process can report
its end, so keep `os._exit` out of rewards, or run the script under a supervisor of your own), processes
started by `forge train --nproc N` (torch's launcher watches them: forge/parallel/launch.py names the process
that failed, and `forge train` says which step is saved), and systems without `os.fork` (Windows).
"""

from __future__ import annotations

import gc
import mmap
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from forge.parallel.launch import how_it_ended
from forge.run.integrity import latest_verified_checkpoint
from forge.run.signals import STOP_SIGNALS, relayed_as


def run_watched(train: Callable[[], int], output_dir: str | os.PathLike) -> int:
    """`train()` in a forked child; returns its exit code in both processes (the parent:
    once the child ended).

    The child returns train()'s result, or raises what it raised, as if it had not forked. The parent returns
    the child's exit code when the child got to the end of train(), else reports the exit (`unfinished_exit`)
    and returns 1."""
    if not hasattr(os, "fork"):
        return train()
    reached_the_end = mmap.mmap(-1, 1)  # shared memory: the child writes 1 once train() returned or raised
    sys.stdout.flush()
    sys.stderr.flush()
    # the child's garbage collector then leaves the parent's objects (and their shared pages) alone
    gc.freeze()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with(parent)
        _take_relayed_signals_as_themselves()
        try:
            code = train()
        except SystemExit:  # sys.exit() that no one caught inside the run: not an end of `forge train`
            raise
        except BaseException:  # a failure the CLI reports (or a bug, with its traceback): the run ended
            reached_the_end[0] = 1
            raise
        reached_the_end[0] = 1
        return code
    status = _wait_passing_signals(child)
    code = os.waitstatus_to_exitcode(status)
    if reached_the_end[0]:
        return code if code >= 0 else 128 - code
    # below a progress bar left open
    print(f"\nforge: error: {unfinished_exit(code, output_dir)}", file=sys.stderr)
    return 1


def unfinished_exit(code: int, output_dir: str | os.PathLike) -> str:
    """What to tell the user when the training process ended before the run did: how it ended (exit code,
    or -signal number) and which checkpoint `--resume` continues from."""
    how = how_it_ended(code)
    if code >= 0:
        how += " before the run ended (os._exit() in a reward or tool ends a process without a word)"
    return f"the training process {how}; {resume_hint(output_dir)}"


def newest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint --resume would continue from (whole files, COMPLETE verified), or None."""
    try:
        newest = latest_verified_checkpoint(output_dir)
    except OSError:
        return None
    return None if newest is None else Path(newest)


def resume_hint(output_dir: str | os.PathLike, resumed_from: Path | None = None) -> str:
    """Which checkpoint of `output_dir` --resume continues from, or that none is saved. resumed_from: the one
    this run resumed from; when it is still the newest, the run stopped on it, and resuming from it
    again is no advice."""
    newest = newest_checkpoint(output_dir)
    if newest is None:
        return f"no finished step is saved in {output_dir}, so start the run again"
    if resumed_from is not None and newest == resumed_from:
        return (
            f"it stopped before finishing a step after {newest}, which it resumed from: if the lines above "
            f"refuse that checkpoint, restore it or remove it to resume from an earlier one"
        )
    return f"the last finished step is saved in {newest}: continue with the same command plus --resume"


def _die_with(parent: int) -> None:
    """Ask Linux to SIGKILL this process when `parent` dies (prctl PR_SET_PDEATHSIG); elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child outlives a killed parent
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _take_relayed_signals_as_themselves() -> None:
    """In the child: a stop signal the parent relays is the signal itself (forge.run.signals.StopSignals,
    during training, counts a signal that came both ways once)."""
    for signum in STOP_SIGNALS:
        if relayed_as(signum) != signum:
            signal.signal(relayed_as(signum),
                          lambda relayed, frame, signum=signum: os.kill(os.getpid(), signum))


def _wait_passing_signals(child: int) -> int:
    """Wait for `child`; meanwhile pass SIGINT, SIGTERM and SIGHUP on to it (nohup's ignored
    SIGHUP excepted)."""
    previous = {
        signum: signal.signal(signum, lambda signum, frame: _pass_on(child, relayed_as(signum)))
        for signum in STOP_SIGNALS
        if not (signum == getattr(signal, "SIGHUP", None) and signal.getsignal(signum) is signal.SIG_IGN)
    }
    try:
        return os.waitpid(child, 0)[1]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _pass_on(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:  # it has just ended
        pass
