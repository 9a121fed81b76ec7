"""Running reward code that may hang or be async: one call under reward_timeout in a helper thread, and the
`async def` rewards of a step awaited together on one event loop (core/scoring.py applies the failure rules to
what comes back).

A timed-out call keeps running in a daemon thread (Python cannot kill a thread); for code that may never
return, run it in a subprocess with `forge.tools.sandbox.run_python`, which is killed on its timeout.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class RewardTimeout(Exception):
    """A reward call ran past reward_timeout."""


def call_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
    """Run fn, waiting at most `timeout` seconds; works from any thread (no signals).

    The call runs in a daemon thread, so a reward that never returns cannot keep the process alive at
    exit; it does keep running (and using a CPU) in the background until it returns."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread below
            outcome["error"] = error

    worker = threading.Thread(target=target, name="forge-reward", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeout(f"no result after {timeout}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def settle(awaitables: list, timeout: float | None) -> list[tuple[bool, Any]]:
    """Await every awaitable concurrently, each under `timeout`: [(True, value) or (False, exception)].

    One event loop in a helper thread, so this works where a loop already runs (a notebook)."""
    async def caught(awaitable) -> tuple[bool, Any]:
        try:
            return True, await awaitable
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - SystemExit/KeyboardInterrupt too, which end the loop
            return False, error  # handed back to the caller, who applies the error rules

    async def one(awaitable) -> tuple[bool, Any]:
        task = asyncio.ensure_future(caught(awaitable))
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            return False, RewardTimeout(f"no result after {timeout}s")
        return task.result()

    async def every() -> list:
        return list(await asyncio.gather(*(one(a) for a in awaitables)))

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(every())
        except BaseException as error:  # noqa: BLE001 - the loop itself failed: every reward of it failed so
            outcome["error"] = error

    worker = threading.Thread(target=target, name="forge-async-rewards", daemon=True)
    worker.start()
    worker.join(None if timeout is None else timeout + 10)  # a coroutine that blocks its loop cannot time out
    if "value" in outcome:
        return outcome["value"]
    return [(False, outcome.get("error") or RewardTimeout(f"no result after {timeout}s"))] * len(awaitables)


def value_of(settled: tuple[bool, Any]) -> Any:
    """The value of a settled call (`settle`), or its exception raised."""
    ok, value = settled
    if not ok:
        raise value
    return value


__all__ = ["RewardTimeout", "call_with_timeout", "settle", "value_of"]
