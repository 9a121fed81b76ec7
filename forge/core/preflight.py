"""Before step 1: can this run learn at all? The checks, and the preflight that samples to find out.

`check_before_training(trainer, rows)` runs when the rows are loaded:
    every prompt fits the model (core/rollout.py check_prompt_lengths)
    every reward gets the arguments it needs (core/reward_sources.py check_reward_columns)
`run_preflight(trainer, rows, total_steps)` runs once the output directory is the run's, before step 1 of a
    new run (GRPOConfig.preflight: 'warn' prints, 'strict' also stops, 'off' skips): a few prompts x G
    sampled with the run's own model, precision, sampling settings and rewards, and one table of what they
    show:
        truncation at max_new_tokens and the lengths of the finished completions
        each reward's mean and spread, and the share of samples where it raised, returned None or NaN/inf
        flat groups (every completion scored the same: no learning signal), at the low or the high end
        tokens per second, the projected seconds per step and for the whole run, the preflight's own time
        the first prompt as the model sees it (chat template applied)
    'strict' stops (PreflightFailed, exit code 2 on the command line) when no group carries signal, when most
    completions are cut at max_new_tokens, or when a reward fails on most samples, naming the fix.

The preflight leaves the run as it found it: the random generators are restored, no weight or optimizer state
changes, so a run trains the same weights bit for bit with it on or off (tests/units/test_preflight.py).
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from forge.core.grpo import group_reward_std
from forge.core.logprobs import checkpointed_layers, micro_batches
from forge.core.reward import TrainerState
from forge.core.reward_sources import check_reward_columns
from forge.core.rollout import check_prompt_lengths, render_prompt
from forge.core.scoring import per_completion, rollout_inputs, score_completions
from forge.run import memory
from forge.run.rng import capture_rng_state, restore_rng_state
from forge.run.signals import note_user_interrupt

MOST = 0.5  # "most" samples, for the strict checks


class PreflightFailed(ValueError):
    """preflight='strict' found that the run cannot learn as set up; the message says what to change."""


@dataclass
class RewardCheck:
    """What one reward did on the preflight's samples."""

    name: str
    mean: float  # over the samples it scored (returned a finite number)
    std: float
    raised: float  # share of samples where it raised or timed out
    none: float  # share where it returned None (does not apply)
    nonfinite: float  # share where it returned NaN/inf


@dataclass
class PreflightReport:
    """What the preflight's prompts x G samples showed; `problems` stop a strict run, `advice` does not."""

    prompts: int
    group_size: int
    max_new_tokens: int
    truncated: float  # share of completions cut at max_new_tokens
    finished_lengths: dict[int, float]  # percentile -> tokens, over the completions that ended by themselves
    rewards: list[RewardCheck]
    # share of groups scored all alike at or below the mean reward (too hard, or a stuck reward)
    flat_low: float
    flat_high: float  # share of groups scored all alike above it (too easy)
    tokens_per_second: float
    step_seconds: float  # projected for one optimizer step of this run
    run_seconds: float  # projected for the whole run
    seconds: float  # the preflight's own time
    prompt_as_seen: str
    memory: memory.MemoryProjection | None = None  # the run's projected peak (None under FSDP2)
    memory_budget_mb: float | None = None  # what it was checked against
    generation_step_seconds: float = 0.0  # the generation part of step_seconds
    max_staleness: int | None = None  # async GRPO: the sampling and the learning overlap
    problems: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)


def check_before_training(trainer, rows: list[dict]) -> None:
    """What must hold before the run starts: every prompt fits the model, every reward gets its arguments."""
    check_prompt_lengths(trainer.tokenizer, rows, trainer.max_prompt_length, trainer.config.truncate_prompts)
    check_reward_columns(trainer.rewards, rows)


def run_preflight(trainer, rows: list[dict], total_steps: int) -> PreflightReport | None:
    """The preflight as GRPOConfig.preflight says: print its table (main process), stop a strict run that
    cannot learn (PreflightFailed), or skip it ('off'). Returns the report."""
    mode = trainer.config.preflight
    if mode == "off" or not rows:
        return None
    with ctrl_c_marked_as_the_users():
        report = preflight(trainer, rows, total_steps)
    too_big = fit_memory(trainer, report)
    if trainer.dist.is_main:
        tqdm.write(format_report(report))
    if too_big:
        raise PreflightFailed(too_big)
    if mode == "strict" and report.problems:
        raise PreflightFailed("preflight (preflight='strict'): " + " ".join(report.problems)
                              + " (preflight='warn' prints this and trains anyway)")
    return report


@contextmanager
def ctrl_c_marked_as_the_users():
    """Ctrl-C raises KeyboardInterrupt marked as the user's (`note_user_interrupt`), as during training, so
    the scoring tells it from a KeyboardInterrupt a reward raises itself, which is the reward's failure."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        note_user_interrupt()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def preflight(trainer, rows: list[dict], total_steps: int) -> PreflightReport:
    """Sample preflight_prompts prompts x G and score them as the run will, leaving the run unchanged."""
    config, group = trainer.config, trainer.config.group_size
    started, rng_state = time.perf_counter(), capture_rng_state()
    # spread over the data
    mine = rows[:: max(1, len(rows) // config.preflight_prompts)][:config.preflight_prompts]
    trainer.model.eval()
    measured = measure(trainer, mine, total_steps)
    restore_rng_state(rng_state)

    rollout = measured.rollout
    lengths = rollout.completion_lengths.float()  # (N,)
    finished = lengths[~rollout.truncated]
    flat, low = flat_groups(measured.scores, group)  # (P,) each
    rollouts_per_step = config.gradient_accumulation_steps * config.prompts_per_step / len(mine)
    step_seconds = projected_step_seconds(config, measured, flat, rollouts_per_step)
    report = PreflightReport(
        prompts=len(mine),
        group_size=group,
        max_new_tokens=config.max_new_tokens,
        truncated=float(rollout.truncated.float().mean()),
        finished_lengths={q: float(torch.quantile(finished, q / 100)) for q in (50, 90, 99)}
        if finished.numel()
        else {},
        rewards=measured.checks,
        flat_low=float(low.float().mean()),
        flat_high=float((flat & ~low).float().mean()),
        tokens_per_second=float(lengths.sum()) / max(measured.generation_seconds, 1e-9),
        step_seconds=step_seconds,
        generation_step_seconds=rollouts_per_step * measured.generation_seconds,
        max_staleness=config.max_staleness,
        run_seconds=step_seconds * total_steps,
        seconds=time.perf_counter() - started,
        prompt_as_seen=render_prompt(trainer.tokenizer, mine[0]["prompt"]),
        memory=None
        if trainer.dist.fsdp
        else projected_memory(trainer, rollout, measured.held, measured.generation_rise, measured.loss_rise),
    )
    judge(report, string_prompts=isinstance(mine[0]["prompt"], str),
          chat_model=bool(getattr(trainer.tokenizer, "chat_template", None)),
          rewards_teach=getattr(trainer, "rewards_teach", True))
    return report


@dataclass
class Measured:
    """What the preflight's prompts cost and scored: the rollout, the total scores and each reward's check,
    the seconds of each phase (scoring: per reward pass) and the MB the memory peak rose above `held`."""

    rollout: Any
    scores: Any
    checks: list[RewardCheck]
    generation_seconds: float
    scoring_seconds: float
    update_seconds: float
    held: float
    generation_rise: float
    loss_rise: float


def measure(trainer, mine: list[dict], total_steps: int) -> Measured:
    """Sample `mine` x G, score them with every reward together and each alone, and time one loss pass."""
    generation_started, held = time.perf_counter(), memory.reset_peak(trainer.device)
    rollout = trainer.sample_completions([row["prompt"] for row in mine], mine)
    generation_seconds = time.perf_counter() - generation_started
    generation_rise = memory.peak_mb(trainer.device) - held
    prompts, columns, _ = per_completion(mine, trainer.config.group_size)
    score = {"on_error": "score", "error_value": 0.0, "timeout": trainer.config.reward_timeout,
             "trainer_state": TrainerState(0, total_steps, trainer.device), **rollout_inputs(rollout)}
    scoring_started = time.perf_counter()
    total = score_completions(trainer.rewards, prompts, rollout.completions, columns, **score)
    checks = [
        reward_check(
            name, score_completions([(name, reward, 1.0)], prompts, rollout.completions, columns, **score)
        )
        for name, reward, _ in trainer.rewards
    ]
    scoring_seconds = (time.perf_counter() - scoring_started) / (len(trainer.rewards) + 1)
    update_seconds, loss_rise = loss_pass(trainer, rollout)
    return Measured(rollout, total, checks, generation_seconds, scoring_seconds, update_seconds, held,
                    generation_rise, loss_rise)


def flat_groups(total, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat, low), (P,) each: the groups whose kept samples all scored alike, and those of them at or below
    the mean reward."""
    kept = total.valid & total.scored  # (N,)
    flat = group_reward_std(total.total, group, kept) == 0  # (P,)
    level = torch.stack(
        [
            total.total[i * group : (i + 1) * group][kept[i * group : (i + 1) * group]].mean()
            if kept[i * group : (i + 1) * group].any()
            else torch.tensor(0.0)
            for i in range(len(flat))
        ]
    )
    middle = float(total.total[kept].mean()) if kept.any() else 0.0
    spread = float(total.total[kept].max() - total.total[kept].min()) if kept.any() else 0.0
    # one value everywhere: judged by its sign
    low = flat & ((level <= middle) if spread > 0 else (level <= 0))
    return flat, low


def projected_step_seconds(config, measured: Measured, flat: torch.Tensor, rollouts_per_step: float) -> float:
    """The seconds of one optimizer step: its rollouts' generation, scoring and loss passes."""
    carrying = 1.0 - float(flat.float().mean()) if config.drop_zero_std_groups else 1.0  # flat: no loss pass
    step_seconds = rollouts_per_step * (measured.generation_seconds + measured.scoring_seconds
                                        + measured.update_seconds * carrying * config.num_iterations)
    # a rollout's optimizer steps: num_iterations passes over it, cut into rollout_slices steps each
    return step_seconds / config.updates_per_rollout


def reward_check(name: str, scores) -> RewardCheck:
    """One reward's RewardCheck from its own Scores (scored alone, failures counted)."""
    n = scores.total.numel()
    applies = scores.applies.get(name, torch.ones(n, dtype=torch.bool))  # (N,)
    values = scores.components[name][applies & scores.valid]
    return RewardCheck(
        name,
        float(values.mean()) if values.numel() else float("nan"),
        float(values.std()) if values.numel() > 1 else 0.0,
        (scores.errors + scores.timeouts) / n,
        float((~applies).float().mean()),
        scores.nonfinite / n,
    )


def loss_pass(trainer, rollout) -> tuple[float, float]:
    """(seconds, MB the memory peak rose) of one forward and backward over the preflight's completions,
    micro-batch by micro-batch as the loss pass runs them; the gradients are dropped again (no weight and no
    optimizer state changes). Not measured under FSDP2."""
    if trainer.dist.fsdp:
        return 0.0, 0.0
    started, held = time.perf_counter(), memory.reset_peak(trainer.device)
    for indices in micro_batches(rollout, trainer.micro_batch_size):  # as the loss pass holds them
        with checkpointed_layers(trainer.model, trainer.config.gradient_checkpointing):
            logprobs, _ = trainer.logprobs(trainer.model, rollout, indices, with_entropy=True)
        (logprobs * 0).sum().backward()
    rise = memory.peak_mb(trainer.device) - held
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started, rise


def projected_memory(trainer, rollout, held: float, generation_rise: float, loss_rise: float
                     ) -> memory.MemoryProjection:
    """The run's peak, scaled from what the preflight's generation and loss pass added to what was `held`."""
    config, rows, run_rows = trainer.config, rollout.completion_ids.shape[0], rollout_rows(trainer)
    prompt = rollout.prompt_ids.shape[1]
    return memory.project(
        generation_rise,
        loss_rise,
        held=held + memory.optimizer_state_mb(trainer.trainable, trainer.optimizer),
        sampled_rows=rows,
        run_rows=run_rows,
        measured_micro_batch=min(trainer.micro_batch_size or rows, rows),
        measured_tokens=prompt + int(rollout.completion_lengths.max()),
        run_micro_batch=min(trainer.micro_batch_size or run_rows, run_rows),
        run_tokens=prompt + config.max_new_tokens,
    )


def rollout_rows(trainer) -> int:
    """Completions in one of this process's rollout batches."""
    return trainer.config.prompts_per_step // trainer.dist.world_size * trainer.config.group_size


def fit_memory(trainer, report: PreflightReport) -> str | None:
    """Check the projected peak against max_memory_mb (default: 90% of what this process holds plus its share
    of what the machine has free): micro_batch_size='auto' takes the largest micro-batch that fits; a run that
    still does not fit stops (the returned message, raised after the report prints), naming what to turn,
    instead of being killed for memory later."""
    config, projection = trainer.config, report.memory
    if projection is None:
        return None
    free = memory.available_mb(trainer.device)
    budget = config.max_memory_mb or (
        None if free is None else 0.9 * (projection.held + (free - projection.held) / trainer.dist.world_size)
    )
    report.memory_budget_mb = budget
    if budget is None:
        return None
    if config.micro_batch_size == "auto":
        fitted = memory.fitting_micro_batch(projection, budget, rollout_rows(trainer))
        if fitted:
            trainer.micro_batch_size = fitted
            report.memory = projection = projection.with_micro_batch(fitted)
    if not trainer.dist.any(projection.peak > budget):
        return None
    return (
        f"this run's memory is projected to peak at {projection.peak:.0f} MB (held {projection.held:.0f}, "
        f"generation +{projection.generation:.0f}, loss pass +{projection.loss_pass:.0f} per micro-batch of "
        f"{projection.micro_batch_size}), over its budget of {budget:.0f} MB (max_memory_mb; default 90% of "
        "what is free): set micro_batch_size='auto' or lower it, turn on gradient_checkpointing, or lower "
        "max_new_tokens or prompts_per_step; raise max_memory_mb only if that memory is there"
    )


def judge(report: PreflightReport, *, string_prompts: bool, chat_model: bool,
          rewards_teach: bool = True) -> None:
    """Fill `problems` (what stops a strict run) and `advice` (what is worth a look), each naming the fix.
    Flat groups are judged only where the rewards enter the loss (not in pure on-policy distillation)."""
    flat = (report.flat_low + report.flat_high) if rewards_teach else 0.0
    if flat >= 1.0:
        scored = ("every group scored low (too hard, or a reward that never pays)" if report.flat_low
                  else "every group scored high (too easy)")
        report.problems.append(
            f"no group of {report.group_size} completions got different rewards, so no step can learn: "
            f"{scored}; screen the prompts (`forge screen`), raise group_size, or use a reward with partial "
            "credit."
        )
    elif flat > MOST:
        report.advice.append(
            f"{flat:.0%} of groups scored alike ({report.flat_low:.0%} low, {report.flat_high:.0%} "
            f"high) and carry no signal; `forge screen` keeps prompts of mixed outcome."
        )
    if report.truncated > MOST:
        p90 = report.finished_lengths.get(90)
        hint = f"; the finished ones needed up to {p90:.0f} tokens (p90)" if p90 else ""
        report.problems.append(
            f"{report.truncated:.0%} of completions were cut at "
            f"max_new_tokens={report.max_new_tokens}{hint}: raise max_new_tokens (e.g. "
            f"{max(2 * report.max_new_tokens, int(2 * (p90 or 0)))}) or ask for shorter answers."
        )
    for check in report.rewards:
        failed = check.raised + check.nonfinite
        if failed > MOST:
            report.problems.append(
                f"reward '{check.name}' failed on {failed:.0%} of samples ({check.raised:.0%} raised, "
                f"{check.nonfinite:.0%} NaN/inf): fix it; on_reward_error='raise' stops at the first failure "
                f"with the sample.")
        if check.none > MOST:
            report.advice.append(
                f"reward '{check.name}' did not apply (returned None) to {check.none:.0%} of samples."
            )
    if string_prompts and chat_model:
        report.advice.append(
            "the prompts are plain strings but the tokenizer has a chat template: they reach the "
            "model without it; give chat messages, or `forge train --chat true`."
        )


def format_report(report: PreflightReport) -> str:
    """The preflight as one compact block for the console."""
    lengths = " ".join(f"p{q} {v:.0f}" for q, v in report.finished_lengths.items()) or "none finished"
    lines = [
        (
            f"forge preflight: {report.prompts} prompts x {report.group_size} completions, "
            f"{report.seconds:.1f} s"
        ),
        (
            f"  completions   {report.truncated:.0%} cut at max_new_tokens={report.max_new_tokens}; finished "
            f"lengths (tokens): {lengths}"
        ),
        f"  flat groups   {report.flat_low:.0%} low, {report.flat_high:.0%} high (no learning signal)",
    ]
    for check in report.rewards:
        lines.append(f"  reward        {check.name}: mean {check.mean:.3g}, std {check.std:.3g}; raised "
                     f"{check.raised:.0%}, None {check.none:.0%}, NaN/inf {check.nonfinite:.0%}")
    lines.append(
        f"  speed         {report.tokens_per_second:.0f} tokens/s generating; ~{report.step_seconds:.1f} s "
        f"per step, ~{report.run_seconds / 60:.1f} min for the run (projected)"
    )
    if report.max_staleness is not None:  # async: each side's share of a step, who waits for whom
        sampling = report.generation_step_seconds
        learning = report.step_seconds - report.generation_step_seconds
        waits = ("the trainer waits for the worker" if sampling > learning
                 else "the worker waits for the trainer")
        lines.append(
            f"  async         sampling ~{sampling:.1f} s and learning ~{learning:.1f} s a step, measured "
            f"on this process's threads: {waits} (max_staleness={report.max_staleness})"
        )
    if report.memory is not None:
        budget = f" of a {report.memory_budget_mb:.0f} MB budget" if report.memory_budget_mb else ""
        lines.append(f"  memory        ~{report.memory.peak:.0f} MB peak{budget} (projected: held "
                     f"{report.memory.held:.0f}, generating +{report.memory.generation:.0f}, loss pass "
                     f"+{report.memory.loss_pass:.0f} per {report.memory.micro_batch_size} completions)")
    seen = report.prompt_as_seen if len(report.prompt_as_seen) <= 300 else \
        report.prompt_as_seen[:150] + " [...] " + report.prompt_as_seen[-150:]
    lines.append(f"  first prompt  {seen!r}")
    lines += [f"  problem: {p}" for p in report.problems] + [f"  note: {a}" for a in report.advice]
    return "\n".join(lines)
