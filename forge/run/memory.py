"""The process's memory: what it holds, its peak, what the machine has free, and whether a run will fit.

On a CPU the figures are the resident set (Linux /proc/self/status: VmRSS now, VmHWM the peak, which
`reset_peak` restarts through /proc/self/clear_refs); on a GPU, the CUDA allocator's own counts. The preflight
(core/preflight.py) measures the peak each phase adds on its few prompts and `project` scales it to the run's
shapes; `fitting_micro_batch` is the largest loss-pass micro-batch a budget leaves room for.

glibc's allocator raises its mmap threshold each time a large block is freed, after which blocks of that size
come from a heap it rarely gives back: the loss pass's per-chunk logits (16 MiB each in fp32) then pile up in
the resident set, the more the more chunks (tests/units/test_chunked_logprobs.py). `return_freed_memory` fixes
the threshold at 8 MiB, so a chunk's blocks are mapped fresh and given back when freed; smaller blocks stay on
the heap, where reusing them is faster (1 MiB cost 4-7% of the demo's step time for 6% of its peak, 8 MiB
nothing measurable; bench/memory_phases.py on the AVX512-BF16 EPYC).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
from dataclasses import dataclass

import torch

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 8 << 20  # blocks of 8 MiB and more are mapped and unmapped, never kept in the heap


def return_freed_memory() -> bool:
    """Have glibc hand blocks of >= 8 MiB back to the system when freed (unless the user set
    MALLOC_MMAP_THRESHOLD_). Returns whether the setting took effect (False off glibc)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def resident_mb(device: torch.device | None = None) -> float:
    """Memory the process holds now: CUDA allocated on a GPU, the resident set elsewhere."""
    if device is not None and device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    now = _status_mb("VmRSS")
    return now if now is not None else peak_mb()


def peak_mb(device: torch.device | None = None) -> float:
    """The peak since the last reset_peak (or since the process began where it cannot be reset)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = _status_mb("VmHWM")
    # Linux: KiB
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak(device: torch.device | None = None) -> float:
    """Restart the peak count from what is held now (freed heap handed back first); returns that."""
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return resident_mb(device)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, AttributeError):
        pass
    return resident_mb(device)


def available_mb(device: torch.device | None = None) -> float | None:
    """What this run may use: what the process holds plus what the machine (GPU) has free; None if unknown."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return (free + torch.cuda.memory_reserved(device)) / 2**20
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024
    except (OSError, StopIteration):
        return None
    return free + resident_mb()


@dataclass
class MemoryProjection:
    """A run's projected peak, in MB: what is held between phases, plus the largest rise of one phase."""

    held: float  # weights, reference, optimizer state (projected once AdamW has it), Python and libraries
    generation: float  # the rise while one rollout batch generates
    loss_pass: float  # the rise of one micro-batch's forward and backward
    micro_batch_size: int  # completions per loss-pass micro-batch that `loss_pass` is for

    @property
    def peak(self) -> float:
        return self.held + max(self.generation, self.loss_pass)

    @property
    def per_row(self) -> float:
        """What one completion adds to the loss pass."""
        return self.loss_pass / max(self.micro_batch_size, 1)

    def with_micro_batch(self, size: int) -> MemoryProjection:
        return dataclasses.replace(self, loss_pass=self.per_row * size, micro_batch_size=size)


def project(
    measured_generation: float,
    measured_loss_pass: float,
    *,
    held: float,
    sampled_rows: int,
    run_rows: int,
    measured_micro_batch: int,
    measured_tokens: int,
    run_micro_batch: int,
    run_tokens: int,
) -> MemoryProjection:
    """Scale the preflight's measured rises to the run's shapes, linearly (activations, KV cache and logit
    chunks all grow with the tokens in flight): generation by the rollout's rows, the loss pass by the
    micro-batch's rows times its longest completion plus the prompt (`*_tokens`: per row, prompt +
    completion)."""
    generation = measured_generation * run_rows / max(sampled_rows, 1)
    per_row_token = measured_loss_pass / max(measured_micro_batch * measured_tokens, 1)
    return MemoryProjection(held, generation, per_row_token * run_micro_batch * run_tokens, run_micro_batch)


def fitting_micro_batch(projection: MemoryProjection, budget: float, rows: int) -> int:
    """The largest micro-batch (<= rows) whose loss pass fits the budget next to what is
    held; 0 if none does."""
    room = budget - projection.held
    if room <= 0:
        return 0
    return rows if projection.per_row <= 0 else max(0, min(rows, int(room // projection.per_row)))


def optimizer_state_mb(parameters, optimizer) -> float:
    """AdamW's two moments for the trainable parameters that do not have them yet (it makes
    them at step 1)."""
    return sum(2 * p.numel() * 4 for p in parameters if p not in optimizer.state) / 2**20
