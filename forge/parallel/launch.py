"""The entry point of `forge train --nproc N`: torch.distributed's launcher, a failed process in one line.

`python -m forge.parallel.launch ARGS` takes torch.distributed.run's arguments and runs it. When a process of
the run fails, torch's launcher stops the others and raises ChildFailedError, which its own entry point prints
as a Python traceback. Here it becomes one line naming the processes that failed and how each ended, and those
the launcher stopped; the exit code is 1. (`forge train` then says which step is saved for --resume.) A stop
signal passed on by `forge train` ends the launcher with 130, once the processes have finished their step and
saved it; so does a stop signal sent to one process alone, which the processes agree on at the step's end
(rank 0's exit is the run's: the other processes exit 0 then, so none is stopped before rank 0 has said where
it saved).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

# What commonly sends a signal that ends a training process, said after its name
SIGNAL_CAUSES = {"SIGKILL": " (the kernel's out-of-memory killer sends it when memory runs out: see `dmesg`)",
                 "SIGSEGV": " (a crash in native code)", "SIGABRT": " (a crash in native code)",
                 "SIGBUS": " (a crash in native code)"}


def how_it_ended(exitcode: int) -> str:
    """'exited with code 1' or 'was killed by SIGSEGV (a crash in native code)' for a process's exit code
    (negative: -signal number), with SIGNAL_CAUSES; forge/run/supervisor.py says one process's end with it."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    number = -exitcode
    name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
    return f"was killed by {name}{SIGNAL_CAUSES.get(name, '')}"


def failures_line(failures: dict) -> str:
    """The processes that failed, and how, from the launcher's {rank: ProcessFailure}. A process the launcher
    stopped (SIGTERM, after another failed) is named as stopped; the timestamps are whole seconds, so which
    one failed first is not known and every failure is named."""
    stopped = [rank for rank, f in sorted(failures.items()) if f.exitcode == -signal.SIGTERM]
    ended = [(rank, f) for rank, f in sorted(failures.items()) if rank not in stopped] or [
        (rank, failures[rank]) for rank in stopped]
    line = ", ".join(f"process {rank} of the run {how_it_ended(f.exitcode)}" for rank, f in ended)
    line += " (its own output is above)" if len(ended) == 1 else " (each one's own output is above)"
    if len(ended) < len(failures):
        line += "; the launcher then stopped " + ", ".join(f"process {rank}" for rank in stopped)
    return line


def stopped_on_a_signal(failures: dict) -> bool:
    """Whether the run stopped as asked, from the launcher's {rank: ProcessFailure}: rank 0 exited 130 (a stop
    signal to any process: every process finished its step, rank 0 saved it and said where), and every other
    process that ended did so too or was stopped by the launcher after rank 0 (the others exit 0 then)."""
    return 0 in failures and failures[0].exitcode == 130 and all(
        f.exitcode in (130, -signal.SIGTERM) for f in failures.values())


def stop_with_parent() -> None:
    """Have Linux send this launcher SIGTERM when `forge train` (FORGE_PARENT_PID) dies (prctl
    PR_SET_PDEATHSIG): it runs in a session of its own, so nothing else would stop its processes then."""
    parent = os.environ.get("FORGE_PARENT_PID")
    if parent is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != int(parent):  # forge train died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class _ForgeNamesTheFailure(logging.Filter):
    """Drop torch's own log line of a process that failed ("failed (exitcode: ...) local_rank: ..."): the
    failure line of `main` names every process and how it ended."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed (exitcode" not in record.getMessage()


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    stop_with_parent()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_ForgeNamesTheFailure())
    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        if stopped_on_a_signal(failed.failures):
            return 130
        print(f"forge: error: {failures_line(failed.failures)}", file=sys.stderr)
        return 1
    except SignalException:  # a stop signal passed on: the processes finished their step, rank 0 saved it
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
