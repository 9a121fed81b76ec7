"""A `forge vllm-serve` that this process starts, waits for and stops: the sampler of `forge demo --async
--generation_backend vllm`, on its own share of the CPU cores.

    with local_server("default", "bfloat16", cores=[1], log=out / "vllm_server.log") as base_url:
        GRPOConfig(..., generation_backend="vllm", vllm_mode="server", vllm_server_base_url=base_url)

The server runs in a process group of its own on a free loopback port; vLLM's CPU engine binds its threads to
`cores` (VLLM_CPU_OMP_THREADS_BIND). Leaving the block stops the whole group, whatever ended it. A server that
exits before it answers, or does not answer within `timeout`, raises with the end of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from forge.model.vllm_engine import wait_for_health


def split_cores(cores: list[int]) -> tuple[list[int], list[int]]:
    """(the trainer's cores, the server's): the first half and the rest; one core is shared."""
    half = len(cores) // 2
    return (cores[:half], cores[half:]) if half else (cores, cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def local_server(model: str, dtype: str, cores: list[int], log: Path,
                 timeout: float = 900.0) -> Iterator[str]:
    """Start `forge vllm-serve --model model` with its threads on `cores` and its output in `log`; yield its
    base URL once /health answers; stop its process group on leaving."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
           "OMP_NUM_THREADS": str(len(cores))}
    command = [sys.executable, "-m", "forge", "vllm-serve", "--model", model, "--port", str(port),
               "--dtype", dtype]
    what, base_url = f"the vLLM server (forge {' '.join(command[3:])})", f"http://127.0.0.1:{port}"
    with open(log, "w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        try:
            wait_for_health(base_url, timeout, exited=lambda: None if server.poll() is None
                            else f"exited with code {server.returncode} before it answered")
        except RuntimeError as why:
            raise RuntimeError(f"{what} {why}; the end of {log}:\n{_log_tail(log)}") from None
        except TimeoutError:
            raise TimeoutError(f"{what} did not answer within {timeout:.0f} s; the end of {log}:\n"
                               f"{_log_tail(log)}") from None
        yield base_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
