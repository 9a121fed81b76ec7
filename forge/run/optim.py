"""The optimizer step of a run: AdamW, the learning-rate schedule, clipping, and never a non-finite weight.

    GuardedStep(...)(loss_is_finite)
        fp16 only: divide the gradient by the loss scale; an overflow halves the scale and skips the step
        clip the gradient to max_grad_norm
        a NaN/inf loss or gradient    -> skip the AdamW step (weights and moments untouched), count it
        AdamW step
        a NaN/inf weight afterwards   -> put the weights back as they were, restart the AdamW moments,
                                         count it
        advance the schedule
    after max_consecutive_nonfinite skipped steps in a row -> FloatingPointError (the weights are finite)

The roll-back keeps one copy of the trainable weights (4 bytes per trainable parameter in fp32; the LoRA
adapters only, under LoRA; this rank's shards only, under FSDP2), refreshed before every step.

fp16 compute (dtype='float16') multiplies the loss by a dynamic scale before backward, so small gradients do
not underflow in fp16 (mixed-precision training, Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740):
it starts at 2**16, halves on every overflow (that step is skipped, not counted towards the abort) and
doubles after 200 steps in a row without one. bf16 and fp32 need no scale (loss_scale stays 1).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or inf. A NaN or inf anywhere makes the sum NaN or inf, so a finite sum
    clears the tensor without the elementwise check (20x faster on SmolLM2-135M's weights, one CPU thread);
    only a non-finite sum, which can also be an overflow of finite values, is checked element by element."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def make_scheduler(optimizer: torch.optim.Optimizer, lr_scheduler: str, warmup_ratio: float,
                   total_steps: int):
    """Linear warmup over warmup_ratio x total_steps, then 'cosine' to 0, 'linear' to 0, or 'constant'."""
    warmup = int(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        if lr_scheduler == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if lr_scheduler == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_new_hyperparameters(optimizer, scheduler, learning_rate: float, weight_decay: float) -> list[str]:
    """After loading a checkpoint's optimizer and schedule: make this run's learning_rate and weight_decay the
    ones that apply from here on (the saved state would otherwise win). Returns what changed, for the log."""
    changes = []
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
        if base != learning_rate:
            changes.append(f"learning_rate {base:g} -> {learning_rate:g}")
        if group.get("weight_decay") != weight_decay:
            changes.append(f"weight_decay {group.get('weight_decay'):g} -> {weight_decay:g}")
    if not changes:
        return []  # nothing to do: the resumed run stays bit for bit the uninterrupted one
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = learning_rate, weight_decay
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = learning_rate * factor(scheduler.last_epoch)  # the rate the next step uses
    return sorted(set(changes))


@dataclass
class StepOutcome:
    grad_norm: float
    stepped: bool  # False: skipped (non-finite loss or gradient) or rolled back (non-finite weights)
    problem: str = ""  # "loss", "gradient" or "weight" when not stepped


class LossScale:
    """fp16's dynamic loss scale: the loss is multiplied by `scale` before backward and the gradients divided
    by it after; an overflow (a non-finite gradient norm) halves it, 200 good steps in a row double it."""

    def __init__(self, scale: float = 2.0**16) -> None:
        self.scale = scale
        self.good_steps = 0

    def unscale(self, grads: list[torch.Tensor]) -> None:
        for p in grads:
            p.grad.div_(self.scale)

    def overflowed(self, grad_norm: float) -> bool:
        """Whether the gradient overflowed; if so the scale is halved (at least 1) and the count restarts."""
        if math.isfinite(grad_norm):
            return False
        self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
        return True

    def good_step(self) -> None:
        self.good_steps += 1
        if self.good_steps % 200 == 0:
            self.scale = min(self.scale * 2, 2.0**24)


class NoLossScale:
    """bf16 and fp32: a scale of 1, nothing to divide, never an overflow."""

    scale = 1.0

    def unscale(self, grads: list[torch.Tensor]) -> None:
        pass

    def overflowed(self, grad_norm: float) -> bool:
        return False

    def good_step(self) -> None:
        pass


class GuardedStep:
    """One optimizer step that never leaves a NaN/inf weight; counts the steps it had to skip."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_grad_norm: float,
                 max_consecutive_nonfinite: int, any_rank: Callable[[bool], bool] = bool,
                 scale_loss: bool = False):
        self.params = params
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.any_rank = any_rank  # True if the flag is True on any process (every process then decides alike)
        self.nonfinite_in_a_row = 0
        self.skipped_steps = 0
        self._backup: list[torch.Tensor] | None = None
        self.scaler = LossScale() if scale_loss else NoLossScale()
        # True from the optimizer step to the end of the step's bookkeeping (the run loop clears it): the
        # weights move to the next step, so a second stop signal waits until it is finished (run/signals.py)
        self.committing = False

    @property
    def loss_scale(self) -> float:
        """What the trainer multiplies the loss by before backward (1 but under fp16)."""
        return self.scaler.scale

    def restore(self, nonfinite_in_a_row: int, skipped_steps: int, loss_scale: float) -> None:
        """The counters of a resumed run, as its checkpoint saved them."""
        self.nonfinite_in_a_row, self.skipped_steps = nonfinite_in_a_row, skipped_steps
        self.scaler.scale = loss_scale

    def __call__(self, loss_is_finite: bool, shards: list[torch.Tensor]) -> StepOutcome:
        """Clip, then step unless the loss, the gradient (fp16: overflowed) or the new weights are NaN/inf;
        `shards`: this process's part of each parameter (FSDP2: its shards), kept to put back bad weights."""
        grads = [p for p in self.params if p.grad is not None]
        self.scaler.unscale(grads)
        grad_norm = _as_float(torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)) if grads else 0.0
        if self.any_rank(not loss_is_finite):
            return self._skip(grad_norm, "loss")
        if self.scaler.overflowed(grad_norm):  # fp16 overflow: a smaller scale, try again
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            return StepOutcome(grad_norm, False, "overflow")
        if not math.isfinite(grad_norm):
            return self._skip(grad_norm, "gradient")
        self._remember_weights(shards)
        self.committing = True
        self.optimizer.step()
        if self.any_rank(not self._weights_are_finite(shards)):
            self._restore_weights(shards)
            return self._skip(grad_norm, "weight")
        self.nonfinite_in_a_row = 0
        self.scaler.good_step()
        return StepOutcome(grad_norm, True)

    def step(self, loss_is_finite: bool, step: int, shards: list[torch.Tensor], *,
             announce: bool = True) -> float:
        """Clip and step (`__call__`); a skipped step leaves the weights of the last finished step (not
        `committing`) and says so on the console (`announce`), and the last of max_consecutive_nonfinite in a
        row raises FloatingPointError. Returns the grad norm."""
        outcome = self(loss_is_finite, shards)
        if not outcome.stepped:
            self.committing = False
            if self.must_abort:
                raise FloatingPointError(self.abort_message(outcome, step))
            if announce:
                tqdm.write(self.skip_message(outcome, step))
        return outcome.grad_norm

    def _skip(self, grad_norm: float, problem: str) -> StepOutcome:
        self.nonfinite_in_a_row += 1
        self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm, False, problem)

    @property
    def must_abort(self) -> bool:
        return self.nonfinite_in_a_row >= self.max_consecutive_nonfinite

    def abort_message(self, outcome: StepOutcome, step: int) -> str:
        return (f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite {_named(outcome)} "
                f"(last at step {step}); the weights were not updated by any of them and are finite. "
                f"{WHAT_TO_DO[outcome.problem]}")

    def skip_message(self, outcome: StepOutcome, step: int) -> str:
        return (f"forge: step {step}: non-finite {_named(outcome)}; optimizer step skipped "
                f"({self.nonfinite_in_a_row} in a row, abort at {self.max_consecutive_nonfinite}). "
                f"{WHAT_TO_DO[outcome.problem]}")

    @torch.no_grad()
    def _remember_weights(self, shards: list[torch.Tensor]) -> None:
        if self._backup is None:
            self._backup = [torch.empty_like(p) for p in shards]
        for backup, p in zip(self._backup, shards):
            backup.copy_(p)

    @torch.no_grad()
    def _weights_are_finite(self, shards: list[torch.Tensor]) -> bool:
        return all(all_finite(p) for p in shards)  # any_rank combines the processes

    @torch.no_grad()
    def _restore_weights(self, shards: list[torch.Tensor]) -> None:
        for backup, p in zip(self._backup, shards):
            p.copy_(backup)
        self.optimizer.state.clear()  # the moments saw the bad update: AdamW restarts them from zero


def _as_float(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s total norm; over FSDP2 shards it is a DTensor, made whole first."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _named(outcome: StepOutcome) -> str:
    return "fp16 gradient" if outcome.problem == "overflow" else outcome.problem


def advance_schedule(scheduler) -> None:
    with warnings.catch_warnings():  # a skipped first step makes torch warn that the order looks wrong
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


WHAT_TO_DO = {
    "loss": "Lower learning_rate, check the rewards for huge values, or use fp32 (dtype='float32').",
    "gradient": "Lower learning_rate or max_grad_norm, or use fp32 (dtype='float32').",
    "overflow": "fp16 gradients overflowed: the loss scale was halved (this is expected now and then).",
    "weight": "The update overflowed the weights' dtype: use fp32 (dtype='float32') or lower learning_rate.",
}
"""What the console and the abort message advise for each kind of non-finite step."""


__all__ = [
    "WHAT_TO_DO",
    "GuardedStep",
    "StepOutcome",
    "advance_schedule",
    "all_finite",
    "apply_new_hyperparameters",
    "make_scheduler",
]
