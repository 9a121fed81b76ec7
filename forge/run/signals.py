"""The stop signals of a run: SIGINT, SIGTERM and SIGHUP finish the step under way, save it and stop the run
with TrainingInterrupted; a second one abandons the step (`StopSignals`). A Ctrl-C that lands inside a reward
is marked as the user's (`note_user_interrupt`), so the scoring lets it through instead of blaming the reward
(`reraise_user_interrupt`). `forge train`'s watching process passes a stop signal on as a real-time signal of
its own (`relayed_as`), so one signal that reached both processes counts once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from tqdm.auto import tqdm


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM/SIGHUP arrived; a checkpoint was written and the message says how to resume."""


_user_interrupt = threading.Event()


def note_user_interrupt() -> None:
    """Mark the KeyboardInterrupt about to be raised as the user's; a signal handler calls this right before
    `raise KeyboardInterrupt`, so the scoring code lets it through instead of blaming the reward."""
    _user_interrupt.set()


def reraise_user_interrupt(error: BaseException) -> None:
    """Re-raise `error` if it is the user's Ctrl-C (see the module docstring); else it is the reward's
    failure."""
    if isinstance(error, KeyboardInterrupt) and (
            _user_interrupt.is_set() or signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        _user_interrupt.clear()
        raise error


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


def relayed_as(signum: int) -> int:
    """The signal `forge train`'s watching process (forge/run/supervisor.py) passes a stop signal on as: a
    real-time signal of its own, so the training process tells one signal that reached both processes (Ctrl-C
    in a terminal, `timeout`, systemd, Slurm: a whole process group) from two; the signal itself without
    them."""
    if not hasattr(signal, "SIGRTMAX"):
        return signum
    return signal.SIGRTMAX - 1 - STOP_SIGNALS.index(signum)


class StopSignals:
    """SIGINT/SIGTERM/SIGHUP during training: the first lets the step under way finish, saves it and stops; a
    second abandons the step under way (KeyboardInterrupt, weights untouched) and the last finished step is
    saved, unless the step's weights are being committed (then it finishes and is saved as after the first).
    SIGHUP is left alone where it is ignored (`nohup`). A signal that reached this process both directly and
    relayed by `forge train`'s watching process (`relayed_as`) counts once.

    Each signal prints what will happen, with the same step numbers as the message the run stops with.
    `next_step()` is the number of the next optimizer step (the last finished one + 1); the run loop sets
    `under_way` (the step being run, as its checkpoint will be numbered; None between steps) and
    `saves_on_abandon` (False where a stop that reaches one process alone cannot save: FSDP2). Use as a
    context manager around the loop; `requested` is the signal number once one arrived; `committing()` says
    whether a step's weights are being committed: the optimizer step's guard marks it (forge/run/optim.py
    GuardedStep.committing) from the optimizer step to the end of the step's bookkeeping."""

    def __init__(self, next_step: Callable[[], int] = lambda: 0,
                 committing: Callable[[], bool] = lambda: False):
        self.next_step = next_step
        self.committing = committing
        self.requested: int | None = None
        self.under_way: int | None = None
        self.saves_on_abandon = True
        self._previous: dict = {}
        self._arrived: dict[tuple[int, bool], int] = {}  # (signal, relayed?) -> how many times

    def __enter__(self):
        self.requested, self._arrived = None, {}
        if hasattr(signal, "SIGTERM") and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signum == getattr(signal, "SIGHUP", None) and signal.getsignal(signum) is signal.SIG_IGN:
                    continue  # nohup's SIGHUP stays ignored
                self._previous[signum] = signal.signal(signum, self._request_stop)
                if relayed_as(signum) != signum:
                    self._previous[relayed_as(signum)] = signal.signal(relayed_as(signum), self._relayed_stop)
        return self

    def __exit__(self, *exc_info) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous, self.under_way = {}, None

    def _relayed_stop(self, relayed, frame) -> None:
        self._request_stop(next(s for s in STOP_SIGNALS if relayed_as(s) == relayed), frame, relayed=True)

    def _request_stop(self, signum, frame, relayed: bool = False) -> None:
        arrived = self._arrived[signum, relayed] = self._arrived.get((signum, relayed), 0) + 1
        if arrived <= self._arrived.get((signum, not relayed), 0):
            return  # the same signal, which reached this process by the other way already
        name, last = signal.Signals(signum).name, self.next_step() - 1
        if self.requested is not None and not self.committing():
            _say(f"forge: a second {name}: step {last + 1} is abandoned; {self.kept(last)}")
            # if it lands inside a reward: the user's interrupt, not the reward's failure
            note_user_interrupt()
            raise KeyboardInterrupt  # second signal: abandon the step under way (weights untouched)
        self.requested = signum
        if self.under_way is None:
            _say(f"forge: {name} received; step {last} is finished: saving it, then stopping")
        elif self.committing():
            _say(f"forge: {name} received; step {self.under_way} is being committed: it finishes, is saved, "
                 f"then the run stops")
        else:
            _say(f"forge: {name} received; step {self.under_way} finishes, is saved, then the run stops "
                 f"(send {name} again to abandon step {last + 1}: {self.kept(last)})")

    def kept(self, last: int) -> str:
        """What a stop that abandons the step under way keeps, when the last finished step is `last`."""
        if last < 1:
            return "no step has finished, so there is no checkpoint"
        if not self.saves_on_abandon:
            return "the newest checkpoint saved so far is kept"
        return f"the last finished step ({last}) is saved"

    def describe(self, step: int, total_steps: int, abandoned: bool = False) -> str:
        """The start of TrainingInterrupted's message: which signal, which step (then: where to resume)."""
        name = signal.Signals(self.requested).name if self.requested else "a signal"
        if abandoned:
            return f"stopped by a second {name}; step {step + 1} was abandoned."
        return f"stopped by {name} after step {step} of {total_steps}."


def _say(line: str) -> None:
    """A signal handler's line; a terminal that hung up (SIGHUP) must not turn the stop into an OSError."""
    try:
        tqdm.write(line)
    except OSError:
        pass
