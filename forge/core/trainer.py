"""GRPOTrainer: owns the policy, the reference, the optimizer and the schedule; runs GRPO steps.

One optimizer step is a recipe (`step`):
    _collect: prompts -> generate G completions each -> score -> group advantages -> loss mask
              -> reference (and, for several updates per rollout, pi_old) log-probs
    _update:  clipped-ratio loss + KL, backward over micro-batches -> clip, AdamW, schedule
    metrics:  core/metrics.py
Around the steps, `train` runs the loop; the run's lifecycle (checkpoints of finished steps, resume, signals,
the messages that say how to resume) lives in core/lifecycle.py.

This module (with its helper core/distributed.py) is the only one that knows about processes: with several
(accelerate / torchrun / forge train --nproc) each rank generates and scores whole groups of its share of
the prompts, gradients are all-reduced, and rank 0 writes logs and checkpoints. The sampling noise is drawn
per step for the whole batch and split like the prompts, so 1 and N processes give the same completions and
the same update, up to fp32 rounding. A NaN/inf loss or gradient skips the optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from forge.core.config import GRPOConfig
from forge.core.grpo import (
    LossNormaliser,
    LossSettings,
    group_reward_std,
    grpo_loss,
    logprob_gap,
    multi_reward_advantages,
)
from forge.core.reward import TrainerState
from forge.core.rollout import (
    Rollout,
    SamplingSettings,
    check_prompt_lengths,
    checkpointed_layers,
    completion_logprobs,
    generate,
    padded_rows,
    prompt_budget,
    sampling_noise,
    sampling_seed,
)
from forge.core.scoring import RewardError, build_reward_list, score_completions
from forge.core.tool_rollout import generate_with_tools
from forge.data.dataset import checked_rows, iterate_steps, reward_kwargs, rows_per_step, training_rows
from forge.logging.logger import ForgeLogger
from forge.model import merged_adapters, prepare_policy
from forge.parallel import sharding
from forge.parallel.distributed import DataParallel
from forge.parallel.sharding import local
from forge.run import metrics as step_stats
from forge.run.lifecycle import (
    CheckpointParts,
    FinishedStep,
    RunLifecycle,
    StopSignals,
    TrainingInterrupted,
    claim_output_dir,
)
from forge.run.optim import GuardedStep, advance_schedule, make_scheduler
from forge.tools.calls import ToolSettings, as_tools, resolve_format

Evaluator = Callable[..., dict]
"""evaluator(model, tokenizer, rows, *, max_new_tokens, max_prompt_length) -> {metric name: value}."""


@dataclass
class Batch:
    """The rollouts of one optimizer step, with everything the loss needs."""

    rollouts: list[Rollout]  # each: P prompts x G completions
    rows: list[list[dict]]  # the dataset rows of each rollout
    advantages: list[torch.Tensor]  # per rollout (N,)
    loss_mask: list[torch.Tensor]  # per rollout (N, T): completion mask x kept-sample flags
    old_logprobs: list[torch.Tensor | None]  # per rollout (N, T) or None (pi_old = stopgrad(pi_theta))
    ref_logprobs: list[torch.Tensor | None]  # per rollout (N, T) or None (kl_beta == 0)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class GRPOTrainer:
    """GRPO fine-tuning of a HuggingFace causal LM.

    model:     a PreTrainedModel (or PeftModel), or a hub id / local path / "default" that Forge loads
    tokenizer: its tokenizer (None when model is a name)
    reward_fn: a BaseReward, a plain f(prompts, completions, **kwargs) -> list[float], or a list of them
    config:    GRPOConfig
    evaluator: what train(eval_dataset=...) measures; None = the mean reward of greedy completions under
               reward_fn (eval/reward, eval/rewards/<name>); `forge.eval.heldout_metrics` gives accuracy
    tools:     typed, docstringed functions the policy may call during rollouts (core/tools.py,
               core/tool_rollout.py; GRPOConfig's tool block); their result tokens are context, not actions
    """

    def __init__(self, model, tokenizer=None, reward_fn=None, config: GRPOConfig | None = None,
                 evaluator: Evaluator | None = None, tools: list[Callable] | None = None):
        self.config = config = (config or GRPOConfig()).validate()
        if reward_fn is None:
            raise ValueError("GRPOTrainer needs reward_fn, e.g. reward_fn=ExactMatchReward()")
        self.rewards = build_reward_list(reward_fn, config.reward_weights)
        self.dist = DataParallel(fsdp=config.fsdp)
        ready = prepare_policy(model, tokenizer, config, device=self.dist.device, seed=seed_everything,
                                      sync=self.dist.broadcast_from_main, announce=self.dist.is_main,
                                      shard=self.dist.shard if self.dist.fsdp else None)
        self.model = model = ready.model
        self.tokenizer, self.reference_model, self.is_lora = ready.tokenizer, ready.reference, ready.is_lora
        self.precision, self.device = ready.precision, next(model.parameters()).device
        self.tool_settings = None if not tools else ToolSettings(
            as_tools(tools), resolve_format(config.tool_format, self.tokenizer), config.max_tool_calling_iterations,
            config.tool_timeout, config.max_tool_output_chars)
        self.evaluator = evaluator or step_stats.greedy_reward_evaluator(self.rewards, config, self.tool_settings)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no trainable parameters (all requires_grad=False)")
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.scheduler = None  # built in train(), once the number of steps is known
        self.initial_params = [local(p).detach().to("cpu", copy=True) for p in self.trainable]  # (FSDP2: shards)
        self._sampling_rng = torch.Generator().manual_seed(sampling_seed(config.seed, 0))  # reseeded each step
        self.global_step = 0
        self.guard = GuardedStep(self.trainable, self.optimizer, config.max_grad_norm,
                                 config.max_consecutive_nonfinite, any_rank=self.dist.any,
                                 scale_loss=self.precision.compute == torch.float16)
        self._warned_zero_std = False
        self.logger: ForgeLogger | None = None
        self.lifecycle: RunLifecycle | None = None  # built in train()
        self._lock = None  # held on output_dir while train() runs
        self.signals = StopSignals(next_step=lambda: self.global_step + 1)
        context = getattr(model.config, "max_position_embeddings", None)
        self.max_prompt_length = prompt_budget(context, config.max_new_tokens, config.max_prompt_length)

    # ------------------------------------------------------------------------------------------------
    # train

    def train(self, dataset: Any, eval_dataset: Any = None) -> dict:
        """Run GRPO over `dataset` (list of {"prompt", "reference", ...}, a HF Dataset, or a JSONL path)."""
        rows, eval_rows, identity = self._load_data(dataset, eval_dataset)  # and claims output_dir
        try:
            return self._run(rows, eval_rows, identity)
        finally:
            if self._lock is not None:
                self._lock.release()

    def _run(self, rows: list[dict], eval_rows: list[dict] | None, identity: dict) -> dict:
        config = self.config
        steps_per_epoch = len(rows) // self.rows_per_step * config.num_iterations  # optimizer steps
        total_steps = config.max_steps if config.max_steps > 0 else steps_per_epoch * config.num_train_epochs
        self.total_steps = total_steps
        self.scheduler = make_scheduler(self.optimizer, config.lr_scheduler, config.warmup_ratio, total_steps)
        self.lifecycle = RunLifecycle(config.output_dir, CheckpointParts(
            self.model, self.tokenizer, self.optimizer, self.scheduler, self._run_config(), self.is_lora,
            identity, sharded_by=self.dist if self.dist.fsdp else None),
            save_total_limit=config.save_total_limit, is_main=self.dist.is_main)
        seed_everything(config.seed)
        epoch, position = 0, 0
        if config.resume_from:
            resumed = self.lifecycle.resume(config.resume_from)
            epoch, position = resumed.epoch, resumed.position
            self.global_step, self.guard.nonfinite_in_a_row = resumed.step, resumed.nonfinite_in_a_row
            self.guard.skipped_steps, self.guard.loss_scale = resumed.skipped_steps, resumed.loss_scale
        self.logger = ForgeLogger(config.output_dir, use_wandb=config.use_wandb, wandb_project=config.wandb_project,
                                  wandb_run_name=config.wandb_run_name, use_tensorboard=config.use_tensorboard,
                                  use_trackio=config.use_trackio, trackio_project=config.trackio_project,
                                  config=self._run_config(), enabled=self.dist.is_main)
        if config.resume_from:
            self.logger.truncate_after(self.global_step)  # rows past the checkpoint come again, once
        if eval_rows is not None and config.eval_before_training and self.global_step == 0:
            self._evaluate(eval_rows, epoch)

        self.lifecycle.finished(self._finished(epoch, position))
        bar = tqdm(total=total_steps, initial=self.global_step, desc="forge", disable=not self.dist.is_main,
                   dynamic_ncols=True)
        steps = iterate_steps(rows, self.rows_per_step, seed=config.seed, shuffle=config.shuffle, epoch=epoch,
                              position=position, num_epochs=None if config.max_steps > 0 else config.num_train_epochs)
        try:
            with self.signals:
                for batch_rows, epoch, position in steps:
                    if self.global_step >= total_steps:
                        break
                    metrics = self.step(batch_rows)
                    metrics["epoch"] = epoch + position / max(1, len(rows))
                    self._after_step(metrics, epoch, position, eval_rows, bar)
                    self._stop_if_asked()
        except (RewardError, FloatingPointError) as error:  # the weights are still those of the last step
            error.args = (f"{error.args[0]}\n{self._where_to_resume()}",)
            self.dist.barrier()  # raised on every rank at once: none exits before rank 0 has saved
            self.logger.close()
            raise
        except KeyboardInterrupt:
            self.logger.close()
            if self.signals.requested is None:
                raise
            head = self.signals.describe(self.global_step, total_steps, abandoned=True)
            raise TrainingInterrupted(f"{head} {self._where_to_resume(every_rank_is_here=False)}") from None
        except BaseException:
            self.logger.close()
            raise
        finally:
            bar.close()
        self.lifecycle.save(self._finished(epoch, position), name="final")  # rank 0 (FSDP2: every rank)
        self.dist.barrier()
        if eval_rows is not None:
            self._evaluate(eval_rows, epoch)
        self.logger.close()
        return {"global_step": self.global_step}

    def _load_data(self, dataset: Any, eval_dataset: Any) -> tuple[list[dict], list[dict] | None, dict]:
        """Load and check everything the run reads before any model work: rows, eval rows, output dir.
        Returns the rows, the eval rows and the rows' identity (size and fingerprint, saved with checkpoints)."""
        config = self.config
        rows, identity = training_rows(dataset)
        self.rows_per_step = rows_per_step(len(rows), config.prompts_per_step, config.prompts_per_optimizer_step)
        eval_rows = None if eval_dataset is None else checked_rows(eval_dataset)
        if config.prompts_per_step % self.dist.world_size:
            raise ValueError(f"prompts_per_step={config.prompts_per_step} must be divisible by the number of "
                             f"processes ({self.dist.world_size}) so every rank gets whole groups")
        check_prompt_lengths(self.tokenizer, rows, self.max_prompt_length, config.truncate_prompts)
        self._lock = claim_output_dir(Path(config.output_dir), resuming=bool(config.resume_from),
                                      overwrite=config.overwrite_output_dir, is_main=self.dist.is_main)
        return rows, eval_rows, identity

    def _after_step(self, metrics: dict, epoch: int, position: int, eval_rows, bar) -> None:
        """Log, evaluate and save after an optimizer step."""
        config, step = self.config, self.global_step
        bar.update(step - bar.n)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
        if _reached(step, config.logging_steps, config.num_iterations) or step == self.total_steps:
            self.logger.log(metrics, step=step, epoch=round(metrics["epoch"], 4))
            self.logger.log_samples(metrics.pop("_samples"), step=step)
        if eval_rows is not None and _reached(step, config.eval_steps, config.num_iterations):
            self._evaluate(eval_rows, epoch)
        # Nothing draws random numbers from here to the next step's sampling: this is the state it will use.
        finished = self._finished(epoch, position)
        if _reached(step, config.save_steps, config.num_iterations):
            self.lifecycle.save(finished)
            self.dist.barrier()  # the other ranks wait until rank 0's checkpoint is complete
        self.lifecycle.finished(finished)

    def _stop_if_asked(self) -> None:
        """After a finished step: a signal to any rank stops all of them here (rank 0 saves the step)."""
        self.signals.committing = False
        if self.dist.any(self.signals.requested is not None):
            message = f"{self.signals.describe(self.global_step, self.total_steps)} {self._where_to_resume()}"
            self.dist.barrier()  # no rank exits (and makes the launcher kill the rest) before the save is done
            raise TrainingInterrupted(message)

    def _where_to_resume(self, every_rank_is_here: bool = True) -> str:
        """Save the last finished step unless an optimizer step is under way; say where to resume from. A
        sharded save needs every rank, so under FSDP2 a stop that may have reached this rank alone (a second
        Ctrl-C) saves nothing new and names the newest checkpoint."""
        last = self.lifecycle.last_finished
        idle = last is not None and last.step == self.global_step and not self.signals.committing
        can_save = every_rank_is_here or not self.dist.fsdp
        return self.lifecycle.where_to_resume(weights_are_of_last_step=idle and can_save)

    def _finished(self, epoch: int, position: int) -> FinishedStep:
        from forge.run import checkpoint as ckpt

        return FinishedStep(self.global_step, epoch, position, ckpt.capture_rng_state(), self._nonfinite_in_a_row,
                            self._skipped_steps, self.guard.loss_scale)

    def _run_config(self) -> dict:
        """The config as saved with checkpoints and compared on resume: GRPOConfig plus the model's name."""
        return {**self.config.to_dict(), "model_name": getattr(self.model.config, "_name_or_path", "") or ""}

    def _evaluate(self, eval_rows: list[dict], epoch: int) -> None:
        with self.precision.autocast(self.model), self._whole_weights(), self._merged():
            metrics = self.evaluator(self.model, self.tokenizer, eval_rows,
                                     max_new_tokens=self.config.max_new_tokens, max_prompt_length=self.max_prompt_length)
        self.logger.log({f"eval/{k}": v for k, v in metrics.items()}, step=self.global_step, epoch=epoch)

    # ------------------------------------------------------------------------------------------------
    # one optimizer step

    def step(self, rows: list[dict]) -> dict:
        """One optimizer step (num_iterations of them when num_iterations > 1) on these dataset rows."""
        self.model.eval()  # dropout off: sampling, pi_old, pi_theta and the reference see the same network
        started = time.perf_counter()
        batch, rollout_stats = self._collect(rows)
        for _ in range(self.config.num_iterations):
            update_stats = self._update(batch)
        metrics = step_stats.step_metrics(
            batch.rollouts, rollout_stats, update_stats, group_size=self.config.group_size, dist=self.dist,
            seconds=time.perf_counter() - started, skipped_steps=self._skipped_steps,
            param_delta_norm=step_stats.param_delta_norm([local(p) for p in self.trainable], self.initial_params,
                                                         total=self.dist.sum_shards))
        metrics["_samples"] = step_stats.gathered_samples(rollout_stats.samples, len(batch.rollouts),
                                                          self.config.log_completions, self.dist)
        if not self._warned_zero_std and self.dist.is_main:
            self._warned_zero_std = step_stats.warn_if_mostly_flat(metrics)
        return metrics

    def _collect(self, rows: list[dict]) -> tuple[Batch, step_stats.RolloutStats]:
        """Generate, score and compute advantages for every rollout of this optimizer step."""
        config, group = self.config, self.config.group_size
        batch, stats = Batch([], [], [], [], [], []), step_stats.RolloutStats()
        # Each rank takes its share of every rollout batch, whole groups only (rank r: prompts r*share..).
        share = config.prompts_per_step // self.dist.world_size
        mine_rows = slice(self.dist.rank * share * group, (self.dist.rank + 1) * share * group)
        self._sampling_rng.manual_seed(sampling_seed(config.seed, self.global_step))
        for start in range(0, len(rows), config.prompts_per_step):
            mine = rows[start:start + config.prompts_per_step][self.dist.rank * share:(self.dist.rank + 1) * share]
            t0 = time.perf_counter()
            rollout = self._generate([row["prompt"] for row in mine])
            stats.gen_seconds += time.perf_counter() - t0
            scores = self._score_on_every_rank(mine, rollout)
            # Advantages of the whole rollout batch (scale_rewards='batch' needs every rank's rewards); keep ours.
            # Samples whose reward was NaN/inf are masked from the loss and left out of the group statistics; a
            # sample no reward applies to (all returned None) gets advantage 0 and leaves the statistics too.
            components, applies = scores.stacked()  # (N, K) each
            advantages = multi_reward_advantages(
                self.dist.gather(components), self.dist.gather(applies), [w for _, _, w in self.rewards], group,
                config.scale_rewards, config.advantage_epsilon, config.multi_objective_aggregation,
                valid=self.dist.gather(scores.valid))[mine_rows]  # (N,)
            keep = scores.valid.clone()  # (N,)
            if config.mask_truncated_completions:
                keep &= ~rollout.truncated
            if config.drop_zero_std_groups:
                informative = group_reward_std(scores.total, group, scores.valid & scores.scored) > 0  # (P,)
                keep &= informative.repeat_interleave(group)
            batch.rollouts.append(rollout)
            batch.rows.append(mine)
            batch.advantages.append(advantages)
            batch.loss_mask.append(rollout.sampled_mask * keep[:, None].long())  # (N, T), tool results excluded
            stats.scores.append(scores.total)
            stats.valid.append(scores.valid & scores.scored)
            for name, values in scores.components.items():
                stats.components.setdefault(name, []).append(values)
                stats.applies.setdefault(name, []).append(scores.applies.get(name, torch.ones_like(scores.valid)))
            stats.errors += scores.errors
            stats.timeouts += scores.timeouts
            stats.nonfinite += scores.nonfinite
            stats.samples.extend(step_stats.rollout_samples(mine, rollout, scores.total, group))
        batch.old_logprobs = [self._old_logprobs(r) for r in batch.rollouts]
        batch.ref_logprobs = [self._reference_logprobs(r) for r in batch.rollouts]
        return batch, stats

    def _generate(self, prompts: list) -> Rollout:
        config = self.config
        settings = SamplingSettings(config.max_new_tokens, config.temperature, config.top_p, config.top_k)
        noise = sampling_noise(self._sampling_rng, len(prompts) * config.group_size, config.max_new_tokens,
                               self.dist.rank, self.dist.world_size)
        # bf16 / fp16 compute over the fp32 master weights, when chosen; the whole weights under FSDP2
        with self.precision.autocast(self.model), self._whole_weights(), self._merged():
            if self.tool_settings is not None:
                return generate_with_tools(self.model, self.tokenizer, prompts, config.group_size, settings,
                                           self.tool_settings, self.max_prompt_length, config.truncate_prompts,
                                           config.share_prompt_prefix, noise=noise)
            return generate(self.model, self.tokenizer, prompts, config.group_size, settings,
                            self.max_prompt_length, config.truncate_prompts, config.share_prompt_prefix,
                            noise=noise)

    def _score_on_every_rank(self, rows: list[dict], rollout: Rollout):
        """Score this rank's rollout; when a reward fails on any rank, every rank raises RewardError here, so
        all of them stop at the same point and rank 0 can save the last finished step (see train())."""
        config, group = self.config, self.config.group_size
        prompts = [row["prompt"] for row in rows for _ in range(group)]
        kwargs = {k: [v for v in values for _ in range(group)] for k, values in reward_kwargs(rows).items()}
        row_ids = [row.get("_row", i) for i, row in enumerate(rows) for _ in range(group)]
        if rollout.tool_calls is not None:  # with tools: each completion's calls and results, in order
            kwargs["tool_calls"] = [[result.as_dict() for result in calls] for calls in rollout.tool_calls]
        try:
            scores, failure = score_completions(
                self.rewards, prompts, rollout.completions, kwargs, on_error=config.on_reward_error,
                error_value=config.reward_error_value, timeout=config.reward_timeout, step=self.global_step + 1,
                row_index=row_ids, trainer_state=TrainerState(self.global_step, getattr(self, "total_steps",
                                                                                         config.max_steps),
                                                              self.device)), None
        except RewardError as error:
            scores, failure = None, error
        if self.dist.any(failure is not None):
            raise failure or RewardError(f"step {self.global_step + 1}: a reward failed in another process; "
                                         f"its error message says which reward and sample, and what to do")
        return scores

    def _logprobs(self, model, rollout: Rollout, indices: torch.Tensor, share_prompt: bool | None = None,
                  **entropy):
        """log-probs (n, T') of the completions `indices` of a rollout, T' = their longest completion (and their
        entropies with with_entropy=True, see completion_logprobs)."""
        length = int(rollout.completion_mask[indices].sum(dim=1).max().clamp(min=1))
        share_prompt = self.config.share_prompt_prefix if share_prompt is None else share_prompt
        with self.precision.autocast(model):  # the same numerics as generation: pi_old = stopgrad(pi) holds
            return completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask,
                                       rollout.completion_ids[indices, :length], rollout.prompt_index[indices],
                                       self.config.temperature, self.config.logprob_chunk_size, share_prompt,
                                       share_template=not self.dist.fsdp, **entropy)

    def _whole_weights(self, model=None):
        """Under FSDP2, the whole weights of `model` (the policy) on every rank: for generation, evaluation and
        the no-grad log-prob passes (core/sharding.py). A no-op otherwise."""
        return sharding.gathered(model or self.model) if self.dist.fsdp else contextlib.nullcontext()

    def _merged(self):
        """LoRA adapters folded into the weights for a no-grad pass (generation, evaluation), unless turned off or
        sharded (policy.merged_adapters)."""
        return merged_adapters(self.model, self.config.merge_lora_for_generation and not self.dist.fsdp)

    def _micro_batches(self, rollout: Rollout, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`rows` (default: all of the rollout's, in order) in chunks of micro_batch_size (0 = one chunk)."""
        rows = torch.arange(rollout.completion_ids.shape[0]) if rows is None else rows
        return list(rows.split(self.config.micro_batch_size or len(rows))) if len(rows) else []

    @torch.no_grad()
    def _old_logprobs(self, rollout: Rollout) -> torch.Tensor | None:
        if self.config.num_iterations == 1:
            return None  # pi_old = stopgrad(pi_theta): no extra forward
        with self._whole_weights():  # FSDP2: gathered once per rollout, not per micro-batch
            return padded_rows([self._logprobs(self.model, rollout, i) for i in self._micro_batches(rollout)],
                               rollout.completion_ids)

    @torch.no_grad()
    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor | None:
        if self.config.kl_beta == 0:
            return None
        parts = []
        with self._whole_weights(self.reference_model or self.model):  # FSDP2: once per rollout
            for indices in self._micro_batches(rollout):
                if self.is_lora:
                    with self.model.disable_adapter():
                        parts.append(self._logprobs(self.model, rollout, indices))
                else:
                    parts.append(self._logprobs(self.reference_model, rollout, indices))
        return padded_rows(parts, rollout.completion_ids)

    def _update(self, batch: Batch) -> dict:
        """Loss and backward over all micro-batches of all rollouts, then one optimizer step."""
        config = self.config
        # Counted over every rank, so each rank's loss is its share of the one loss of the whole batch.
        normaliser = LossNormaliser.count(batch.loss_mask, config.max_new_tokens, total=self.dist.sum)
        settings, totals = config.loss_settings, step_stats.UpdateTotals()
        self.optimizer.zero_grad(set_to_none=True)
        with sharding.kept_until_backward(self.model, enabled=self.dist.fsdp):  # FSDP2: one gather per unit
            self._loss_pass(batch, normaliser, settings, totals)
        return self._finish_update(totals)

    def _loss_pass(self, batch: Batch, normaliser: LossNormaliser, settings: LossSettings,
                   totals: step_stats.UpdateTotals) -> None:
        """Loss and backward of every micro-batch of every rollout; gradients accumulate in .grad."""
        config = self.config
        for r, rollout in enumerate(batch.rollouts):
            # Rows without a loss token (dropped groups, masked samples) are left out before chunking, so no
            # forward is spent on them; FSDP2 keeps every row, as forward and backward are collectives that
            # need the same number of micro-batches on every rank.
            carrying = None if self.dist.fsdp else batch.loss_mask[r].any(dim=1).nonzero().squeeze(1)
            for indices in self._micro_batches(rollout, carrying):
                mask = batch.loss_mask[r][indices]
                # Gradient checkpointing recomputes layers in backward, which a shared prompt cache cannot
                # survive: each completion then carries its own copy of the prompt.
                with checkpointed_layers(self.model, config.gradient_checkpointing):
                    logprobs, entropy = self._logprobs(self.model, rollout, indices,
                                                       share_prompt=config.share_prompt_prefix
                                                       and not config.gradient_checkpointing, with_entropy=True,
                                                       entropy_grad=config.entropy_coef != 0)  # (n, T') each
                length = logprobs.shape[1]
                old, ref, sampler = batch.old_logprobs[r], batch.ref_logprobs[r], rollout.sampler_logprobs
                old = None if old is None else old[indices, :length].to(self.device)
                sampler = None if sampler is None else sampler[indices, :length].to(self.device)
                part_mask = mask[:, :length].to(self.device)
                loss, stats = grpo_loss(
                    logprobs, old, None if ref is None else ref[indices, :length].to(self.device),
                    batch.advantages[r][indices].to(self.device), part_mask, normaliser=normaliser,
                    settings=settings, entropy=entropy, sampler_logprobs=sampler)
                # Each rank's loss carries its share; all-reduce (sum) of gradients gives the global loss.
                (loss * self.guard.loss_scale).backward()  # the scale is 1 but under fp16 (core/optim.py)
                gap = None if sampler is None else logprob_gap(logprobs if old is None else old, sampler,
                                                               part_mask)  # sampler vs the trainer's pi_old
                totals.add(loss, stats, float(mask.sum()), gap)

    def _finish_update(self, totals: step_stats.UpdateTotals) -> dict:
        """Sum the gradients over the ranks (data-parallel), the statistics over the ranks, then the step."""
        config = self.config
        self.dist.all_reduce_grads(self.trainable)
        totals = totals.over_every_rank(self.dist, with_rollout_is=config.rollout_is != "none")
        totals["learning_rate"] = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        totals["grad_norm"] = self._clip_and_step(loss_is_finite=math.isfinite(totals["loss"]))
        return totals

    def _clip_and_step(self, loss_is_finite: bool = True) -> float:
        """Clip and step (core/optim.py GuardedStep: a NaN/inf loss, gradient or resulting weight skips the
        step and leaves the weights as they were), advance the schedule, count the step."""
        outcome = self.guard(loss_is_finite, before_commit=self._commit)
        if not outcome.stepped:
            self.signals.committing = False  # the weights are (back to) those of the last finished step
            if self.guard.must_abort:
                raise FloatingPointError(self.guard.abort_message(outcome, self.global_step + 1))
            if self.dist.is_main:
                tqdm.write(self.guard.skip_message(outcome, self.global_step + 1))
        advance_schedule(self.scheduler)
        self.global_step += 1
        return outcome.grad_norm

    def _commit(self) -> None:
        self.signals.committing = True  # the weights now move to the next step: a second signal must wait

    @property
    def _nonfinite_in_a_row(self) -> int:
        return self.guard.nonfinite_in_a_row

    @property
    def _skipped_steps(self) -> int:
        return self.guard.skipped_steps


def _reached(step: int, every: int, stride: int) -> bool:
    """Whether the last `stride` optimizer steps (the updates of one rollout) reached or passed a multiple of
    `every` (0 = never); with stride 1 this is step % every == 0."""
    return every > 0 and step // every > (step - stride) // every


__all__ = ["Batch", "GRPOTrainer", "RewardError", "TrainingInterrupted", "seed_everything"]
