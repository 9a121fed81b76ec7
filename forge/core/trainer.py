"""GRPOTrainer: owns the policy, the reference, the optimizer and the schedule; runs GRPO steps.

One optimizer step is a recipe:
    prompts -> generate G completions each -> score -> group advantages
            -> reference (and, for several updates per rollout, pi_old) log-probs
            -> clipped-ratio loss + k3 KL, backward over micro-batches -> clip, AdamW, schedule -> log

This module (with its helper core/distributed.py) is the only one that knows about processes: with several
(accelerate / torchrun / forge train --nproc) each rank generates and scores whole groups of its share of
the prompts, gradients are all-reduced, and rank 0 writes logs and checkpoints. The sampling noise is drawn
per step for the whole batch and split like the prompts, so 1 and N processes give the same completions and
the same update, up to fp32 rounding.

A run is never lost: a checkpoint holds weights, optimizer, schedule, step, (epoch, position) in the
seeded per-epoch shuffle and every RNG state, taken right where the next step starts, so a resumed run
repeats the uninterrupted one bit for bit. SIGINT/SIGTERM finish the step, save and raise
TrainingInterrupted; a failing reward leaves the last finished step saved; a NaN/inf loss or gradient
skips the optimizer step.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from forge.core.distributed import DataParallel
from forge.core.grpo import GRPOConfig, LossNormaliser, compute_group_advantages, group_reward_std, grpo_loss
from forge.core.rollout import Rollout, SamplingSettings, checkpointed_layers, completion_logprobs, generate
from forge.core.scoring import RewardError, build_reward_list, score_completions
from forge.data.dataset import load_rows, reward_kwargs, validate_rows
from forge.logging.logger import ForgeLogger


@dataclass
class Batch:
    """The rollouts of one optimizer step, with everything the loss needs."""

    rollouts: list[Rollout]  # each: P prompts x G completions
    rows: list[list[dict]]  # the dataset rows of each rollout
    advantages: list[torch.Tensor]  # per rollout (N,)
    loss_mask: list[torch.Tensor]  # per rollout (N, T): completion mask x kept-sample flags
    old_logprobs: list[torch.Tensor | None]  # per rollout (N, T) or None (pi_old = stopgrad(pi_theta))
    ref_logprobs: list[torch.Tensor | None]  # per rollout (N, T) or None (kl_beta == 0)


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM arrived; a checkpoint was written and the message says how to resume."""


@dataclass
class FinishedStep:
    """Where the last finished optimizer step left the run: what a checkpoint of it must hold."""

    step: int
    epoch: int
    position: int  # rows of this epoch's shuffled order already used
    rng_state: dict  # every generator, as the next step will find it


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
    """

    def __init__(self, model, tokenizer=None, reward_fn=None, config: GRPOConfig | None = None):
        from forge.core import policy

        self.config = config = (config or GRPOConfig()).validate()
        if reward_fn is None:
            raise ValueError("GRPOTrainer needs reward_fn, e.g. reward_fn=ExactMatchReward()")
        self.rewards = build_reward_list(reward_fn, config.reward_weights)
        self.dist = DataParallel()
        if isinstance(model, (str, os.PathLike)):
            model, tokenizer = policy.load_model(str(model), dtype=config.dtype)
        if tokenizer is None:
            raise ValueError("GRPOTrainer needs the model's tokenizer")
        self.tokenizer = policy.prepare_tokenizer(tokenizer)
        if config.use_lora or policy.is_peft_model(model):
            seed_everything(config.seed)  # the adapters' random init is part of the seeded run
            model = policy.apply_lora(model, r=config.lora_r, alpha=config.lora_alpha,
                                      dropout=config.lora_dropout, target_modules=config.lora_target_modules)
        if self.dist.device is not None:
            model = model.to(self.dist.device)  # several processes on GPUs: one GPU per rank
        # Every rank must start from the same weights: the seeded LoRA init already is, rank 0's copy makes sure.
        self.dist.broadcast_from_main([p for p in model.parameters() if p.requires_grad])
        self.model = model
        self.is_lora = policy.is_peft_model(model)
        if config.gradient_checkpointing:
            policy.enable_checkpointing(model)
        # LoRA: the reference is the same weights with adapters off. Full: a frozen copy, only if needed.
        self.reference_model = None
        if config.kl_beta > 0 and not self.is_lora:
            self.reference_model = policy.make_reference_model(model)
        self.device = next(model.parameters()).device
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no trainable parameters (all requires_grad=False)")
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.scheduler = None  # built in train(), once the number of steps is known
        self.initial_params = [p.detach().to("cpu", copy=True) for p in self.trainable]
        self._sampling_rng = torch.Generator().manual_seed(_sampling_seed(config.seed, 0))  # reseeded each step
        self.global_step = 0
        self.logger: ForgeLogger | None = None
        self._stop_signal: int | None = None
        self._committing = False  # between optimizer.step() and the end of _after_step: a 2nd signal waits
        self._last_finished: FinishedStep | None = None
        self._saved: tuple[int, Path] | None = None  # (step, path) of the newest checkpoint of this run
        self._dataset_identity: dict = {}
        self._nonfinite_in_a_row = 0
        self._skipped_steps = 0
        self._warned_zero_std = False
        self.max_prompt_length = self._prompt_budget()

    # ------------------------------------------------------------------------------------------------
    # train

    def train(self, dataset: Any, eval_dataset: Any = None) -> dict:
        """Run GRPO over `dataset` (list of {"prompt", "reference", ...}, a HF Dataset, or a JSONL path)."""
        from forge import checkpoint as ckpt

        config = self.config
        rows = load_rows(dataset)
        validate_rows(rows)
        self.rows_per_step = self._rows_per_step(len(rows))
        self._dataset_identity = _dataset_identity(rows)
        for index, row in enumerate(rows):
            row["_row"] = index  # named in reward error messages; never passed to the rewards
        eval_rows = None
        if eval_dataset is not None:
            eval_rows = load_rows(eval_dataset)
            validate_rows(eval_rows)
        if config.prompts_per_step % self.dist.world_size:
            raise ValueError(f"prompts_per_step={config.prompts_per_step} must be divisible by the number of "
                             f"processes ({self.dist.world_size}) so every rank gets whole groups")
        self._check_output_dir(Path(config.output_dir))
        self._check_prompt_lengths(rows)

        steps_per_epoch = len(rows) // self.rows_per_step * config.num_iterations  # optimizer steps
        total_steps = config.max_steps if config.max_steps > 0 else steps_per_epoch * config.num_train_epochs
        self.total_steps = total_steps
        self.scheduler = _make_scheduler(self.optimizer, config, total_steps)
        seed_everything(config.seed)
        epoch, position = 0, 0
        if config.resume_from:
            epoch, position = self._resume(config.resume_from)
        self.logger = ForgeLogger(config.output_dir, use_wandb=config.use_wandb, wandb_project=config.wandb_project,
                                  wandb_run_name=config.wandb_run_name, use_tensorboard=config.use_tensorboard,
                                  config=self._run_config(), enabled=self.dist.is_main)
        if config.resume_from:
            self.logger.truncate_after(self.global_step)  # rows past the checkpoint come again, once
        if eval_rows is not None and config.eval_before_training and self.global_step == 0:
            self._evaluate(eval_rows, epoch)

        self._last_finished = FinishedStep(self.global_step, epoch, position, ckpt.capture_rng_state())
        self._stop_signal, self._committing = None, False
        previous_handlers = self._install_signal_handlers()
        bar = tqdm(total=total_steps, initial=self.global_step, desc="forge", disable=not self.dist.is_main,
                   dynamic_ncols=True)
        try:
            for batch_rows, epoch, position in self._iterate(rows, epoch, position):  # noqa: B020 - resumes them
                if self.global_step >= total_steps:
                    break
                metrics = self.step(batch_rows)
                metrics["epoch"] = epoch + position / max(1, len(rows))
                self._after_step(metrics, epoch, position, eval_rows, bar)
        except RewardError as error:  # raised while scoring: the weights are still those of the last step
            error.args = (f"{error.args[0]}\n{self._where_to_resume()}",)
            self.dist.barrier()  # raised on every rank at once: none exits before rank 0 has saved
            self.logger.close()
            raise
        except KeyboardInterrupt:
            self.logger.close()
            if self._stop_signal is None:
                raise
            raise TrainingInterrupted(self._interrupted_message(abandoned=True)) from None
        except BaseException:
            self.logger.close()
            raise
        finally:
            bar.close()
            self._restore_signal_handlers(previous_handlers)
        if self.dist.is_main:
            self._save(Path(config.output_dir) / "final", epoch, position)
        self.dist.barrier()
        if eval_rows is not None:
            self._evaluate(eval_rows, epoch)
        self.logger.close()
        return {"global_step": self.global_step}

    def _rows_per_step(self, num_rows: int) -> int:
        """Rows one optimizer step uses: prompts_per_step x gradient_accumulation_steps, or every whole rollout
        batch of a dataset smaller than that (with a warning), so a small dataset still trains."""
        config = self.config
        wanted = config.prompts_per_optimizer_step
        if num_rows >= wanted:
            return wanted
        usable = num_rows - num_rows % config.prompts_per_step
        if usable == 0:
            raise ValueError(f"the dataset has {num_rows} rows, fewer than prompts_per_step={config.prompts_per_step}"
                             f"; add rows or lower prompts_per_step")
        warnings.warn(f"the dataset has {num_rows} rows but one optimizer step asks for prompts_per_step x "
                      f"gradient_accumulation_steps = {wanted}; each step uses {usable} rows instead", stacklevel=3)
        return usable

    def _iterate(self, rows: list[dict], epoch: int, position: int) -> Iterator[tuple[list[dict], int, int]]:
        """Yield (rows of one optimizer step, epoch, position after it); a seeded shuffle per epoch."""
        per_step = self.rows_per_step
        while True:
            order = list(range(len(rows)))
            if self.config.shuffle:
                random.Random(self.config.seed + epoch).shuffle(order)
            while position + per_step <= len(rows):
                picked = [rows[i] for i in order[position:position + per_step]]
                position += per_step
                yield picked, epoch, position
            epoch, position = epoch + 1, 0
            if self.config.max_steps <= 0 and epoch >= self.config.num_train_epochs:
                return

    def _after_step(self, metrics: dict, epoch: int, position: int, eval_rows, bar) -> None:
        """Log, evaluate and save after an optimizer step; then stop if a signal asked for it."""
        from forge import checkpoint as ckpt

        config, step = self.config, self.global_step
        bar.update(step - bar.n)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
        if _reached(step, config.logging_steps, config.num_iterations) or step == self.total_steps:
            self.logger.log(metrics, step=step, epoch=round(metrics["epoch"], 4))
            self.logger.log_samples(metrics.pop("_samples"), step=step)
        if eval_rows is not None and _reached(step, config.eval_steps, config.num_iterations):
            self._evaluate(eval_rows, epoch)
        if _reached(step, config.save_steps, config.num_iterations):
            if self.dist.is_main:
                self._save(Path(config.output_dir) / str(step), epoch, position)
            self.dist.barrier()  # the other ranks wait until rank 0's checkpoint is complete
        # Nothing draws random numbers from here to the next step's sampling: this is the state it will use.
        self._last_finished = FinishedStep(step, epoch, position, ckpt.capture_rng_state())
        self._committing = False
        if self.dist.any(self._stop_signal is not None):  # a signal to any rank stops all after the same step
            message = self._interrupted_message(abandoned=False)  # rank 0 saves this step
            self.dist.barrier()  # no rank exits (and makes the launcher kill the rest) before the save is done
            raise TrainingInterrupted(message)

    # ------------------------------------------------------------------------------------------------
    # one optimizer step

    def step(self, rows: list[dict]) -> dict:
        """One optimizer step (num_iterations of them when num_iterations > 1) on these dataset rows."""
        config = self.config
        self.model.eval()  # dropout off: sampling, pi_old, pi_theta and the reference see the same network
        started = time.perf_counter()
        batch, rollout_stats = self._collect(rows)
        generated_at = time.perf_counter()
        for _ in range(config.num_iterations):
            update_stats = self._update(batch)
        finished = time.perf_counter()
        return self._metrics(batch, rollout_stats, update_stats, started, generated_at, finished)

    def _collect(self, rows: list[dict]) -> tuple[Batch, dict]:
        """Generate, score and compute advantages for every rollout of this optimizer step."""
        config = self.config
        batch = Batch([], [], [], [], [], [])
        stats = {"scores": [], "valid": [], "components": {}, "errors": 0, "timeouts": 0, "nonfinite": 0, "gen_seconds": 0.0,
                 "samples": []}
        # Each rank takes its share of every rollout batch, whole groups only (rank r: prompts r*share..).
        share = config.prompts_per_step // self.dist.world_size
        rows_per_rank = share * config.group_size
        mine_rows = slice(self.dist.rank * rows_per_rank, (self.dist.rank + 1) * rows_per_rank)
        self._sampling_rng.manual_seed(_sampling_seed(config.seed, self.global_step))
        for start in range(0, len(rows), config.prompts_per_step):
            chunk = rows[start:start + config.prompts_per_step]
            mine = chunk[self.dist.rank * share:(self.dist.rank + 1) * share]
            t0 = time.perf_counter()
            rollout = self._generate([row["prompt"] for row in mine])
            stats["gen_seconds"] += time.perf_counter() - t0
            scores = self._score_on_every_rank(mine, rollout)
            # Advantages of the whole rollout batch (scale_rewards='batch' needs every rank's rewards); keep ours.
            # Samples whose reward was NaN/inf are masked from the loss and left out of the group statistics.
            advantages = compute_group_advantages(self.dist.gather(scores.total), config.group_size,
                                                  config.scale_rewards, config.advantage_epsilon,
                                                  valid=self.dist.gather(scores.valid))  # (N_total,)
            advantages = advantages[mine_rows]  # (N,)
            keep = scores.valid.clone()  # (N,)
            if config.mask_truncated_completions:
                keep &= ~rollout.truncated
            if config.drop_zero_std_groups:
                informative = group_reward_std(scores.total, config.group_size, scores.valid) > 0  # (P,)
                keep &= informative.repeat_interleave(config.group_size)
            batch.rollouts.append(rollout)
            batch.rows.append(mine)
            batch.advantages.append(advantages)
            batch.loss_mask.append(rollout.completion_mask * keep[:, None].long())
            stats["scores"].append(scores.total)
            stats["valid"].append(scores.valid)
            for name, values in scores.components.items():
                stats["components"].setdefault(name, []).append(values)
            stats["errors"] += scores.errors
            stats["timeouts"] += scores.timeouts
            stats["nonfinite"] += scores.nonfinite
            stats["samples"].extend(self._samples(mine, rollout, scores.total))
        batch.old_logprobs = [self._old_logprobs(r) for r in batch.rollouts]
        batch.ref_logprobs = [self._reference_logprobs(r) for r in batch.rollouts]
        return batch, stats

    def _generate(self, prompts: list) -> Rollout:
        config = self.config
        settings = SamplingSettings(config.max_new_tokens, config.temperature, config.top_p, config.top_k)
        return generate(self.model, self.tokenizer, prompts, config.group_size, settings,
                        self.max_prompt_length, config.truncate_prompts, config.share_prompt_prefix,
                        noise=self._sampling_noise(len(prompts)))

    def _sampling_noise(self, num_prompts: int) -> torch.Tensor:
        """(num_prompts * G, max_new_tokens) uniforms that sample this rank's completions.

        Every rank draws the noise of the whole rollout batch (all ranks' prompts) from a generator seeded by
        (seed, step) and keeps its own rows: ranks never share draws, yet each prompt gets the same draws on
        1 or N processes, so a run's completions do not depend on the number of processes, and resuming at
        a step needs no saved sampler state."""
        rows = num_prompts * self.config.group_size
        noise = torch.rand(rows * self.dist.world_size, self.config.max_new_tokens, dtype=torch.float64,
                           generator=self._sampling_rng)  # (N_total, T)
        return noise[self.dist.rank * rows:(self.dist.rank + 1) * rows]  # (N, T)

    def _score_on_every_rank(self, rows: list[dict], rollout: Rollout):
        """Score this rank's rollout; when a reward fails on any rank, every rank raises RewardError here, so
        all of them stop at the same point and rank 0 can save the last finished step (see train())."""
        try:
            scores, failure = self._score(rows, rollout), None
        except RewardError as error:
            scores, failure = None, error
        if self.dist.any(failure is not None):
            raise failure or RewardError(f"step {self.global_step + 1}: a reward failed in another process; "
                                         f"its error message says which reward and sample, and what to do")
        return scores

    def _score(self, rows: list[dict], rollout: Rollout):
        config, group = self.config, self.config.group_size
        prompts = [row["prompt"] for row in rows for _ in range(group)]
        kwargs = {k: [v for v in values for _ in range(group)] for k, values in reward_kwargs(rows).items()}
        row_ids = [row.get("_row", i) for i, row in enumerate(rows) for _ in range(group)]
        return score_completions(self.rewards, prompts, rollout.completions, kwargs,
                                 on_error=config.on_reward_error, error_value=config.reward_error_value,
                                 timeout=config.reward_timeout, step=self.global_step + 1, row_index=row_ids)

    def _logprobs(self, model, rollout: Rollout, indices: torch.Tensor, share_prompt: bool | None = None):
        """log-probs (n, T') of the completions `indices` of a rollout, T' = their longest completion."""
        length = int(rollout.completion_mask[indices].sum(dim=1).max().clamp(min=1))
        share_prompt = self.config.share_prompt_prefix if share_prompt is None else share_prompt
        return completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask,
                                   rollout.completion_ids[indices, :length], rollout.prompt_index[indices],
                                   self.config.temperature, self.config.logprob_chunk_size, share_prompt)

    def _micro_batches(self, rollout: Rollout) -> list[torch.Tensor]:
        size = self.config.micro_batch_size or rollout.completion_ids.shape[0]
        return list(torch.arange(rollout.completion_ids.shape[0]).split(size))

    @torch.no_grad()
    def _old_logprobs(self, rollout: Rollout) -> torch.Tensor | None:
        if self.config.num_iterations == 1:
            return None  # pi_old = stopgrad(pi_theta): no extra forward
        return self._padded([self._logprobs(self.model, rollout, i) for i in self._micro_batches(rollout)], rollout)

    @torch.no_grad()
    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor | None:
        if self.config.kl_beta == 0:
            return None
        parts = []
        for indices in self._micro_batches(rollout):
            if self.is_lora:
                with self.model.disable_adapter():
                    parts.append(self._logprobs(self.model, rollout, indices))
            else:
                parts.append(self._logprobs(self.reference_model, rollout, indices))
        return self._padded(parts, rollout)

    @staticmethod
    def _padded(parts: list[torch.Tensor], rollout: Rollout) -> torch.Tensor:
        full = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32)
        row = 0
        for part in parts:
            full[row:row + part.shape[0], :part.shape[1]] = part.cpu()
            row += part.shape[0]
        return full

    def _update(self, batch: Batch) -> dict:
        """Loss and backward over all micro-batches of all rollouts, then one optimizer step."""
        config = self.config
        # Counted over every rank, so each rank's loss is its share of the one loss of the whole batch.
        num_sequences = sum(float((m.sum(dim=1) > 0).sum()) for m in batch.loss_mask)
        num_tokens = sum(float(m.sum()) for m in batch.loss_mask)
        num_sampled = sum(float(m.shape[0]) for m in batch.loss_mask)
        num_sequences, num_tokens, num_sampled = self.dist.sum([num_sequences, num_tokens, num_sampled])
        normaliser = LossNormaliser(max(num_sequences, 1.0), max(num_tokens, 1.0), config.max_new_tokens,
                                    num_sampled)
        totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0,
                  "ratio_mean": 0.0}
        weight_sum = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for r, rollout in enumerate(batch.rollouts):
            for indices in self._micro_batches(rollout):
                mask = batch.loss_mask[r][indices]
                if mask.sum() == 0:
                    continue
                # Gradient checkpointing recomputes layers in backward, which a shared prompt cache cannot
                # survive: each completion then carries its own copy of the prompt.
                with checkpointed_layers(self.model, config.gradient_checkpointing):
                    logprobs = self._logprobs(self.model, rollout, indices,
                                              share_prompt=config.share_prompt_prefix
                                              and not config.gradient_checkpointing)  # (n, T')
                length = logprobs.shape[1]
                old, ref = batch.old_logprobs[r], batch.ref_logprobs[r]
                loss, stats = grpo_loss(
                    logprobs, None if old is None else old[indices, :length].to(self.device),
                    None if ref is None else ref[indices, :length].to(self.device),
                    batch.advantages[r][indices].to(self.device), mask[:, :length].to(self.device),
                    clip_eps_low=config.clip_epsilon, clip_eps_high=config.epsilon_high, kl_beta=config.kl_beta,
                    loss_type=config.loss_type, importance_level=config.importance_sampling_level,
                    normaliser=normaliser)
                # Each rank's loss carries its share; all-reduce (sum) of gradients gives the global loss.
                loss.backward()
                tokens = float(mask.sum())
                totals["loss"] += float(loss.detach())
                for key in ("kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean"):
                    totals[key] += float(getattr(stats, key)) * tokens
                weight_sum += tokens
        self.dist.all_reduce_grads(self.trainable)
        # The loss is the sum of the ranks' shares; the statistics are token-weighted means over every rank.
        keys = ("kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean")
        summed = self.dist.sum([totals["loss"], weight_sum, *(totals[key] for key in keys)])
        totals["loss"], weight_sum = summed[0], summed[1]
        for key, value in zip(keys, summed[2:]):
            totals[key] = value / max(weight_sum, 1.0)
        totals["learning_rate"] = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        totals["grad_norm"] = self._clip_and_step(loss_is_finite=math.isfinite(totals["loss"]))
        return totals

    def _clip_and_step(self, loss_is_finite: bool = True) -> float:
        """Clip, then step the optimizer unless the loss or gradient went non-finite (then skip, and count)."""
        config = self.config
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        grads = [p for p in self.trainable if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm)) if grads else 0.0
        ranks_with_bad_loss = self.dist.sum([0.0 if loss_is_finite else 1.0])[0]  # every rank skips, or none
        if not math.isfinite(grad_norm) or ranks_with_bad_loss > 0:
            self._nonfinite_in_a_row += 1
            self._skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            what = "loss" if ranks_with_bad_loss > 0 else "gradient"
            if self._nonfinite_in_a_row >= config.max_consecutive_nonfinite:
                raise FloatingPointError(
                    f"{self._nonfinite_in_a_row} optimizer steps in a row had a non-finite {what} (last at step "
                    f"{self.global_step + 1}); the weights were not updated by any of them. Lower learning_rate, "
                    f"check the rewards for huge values, or use fp32 (dtype='float32'). Checkpoints already "
                    f"written in {config.output_dir} are intact: resume from the newest with --resume.")
            if self.dist.is_main:
                tqdm.write(f"forge: step {self.global_step + 1}: non-finite {what}; optimizer step skipped "
                           f"({self._nonfinite_in_a_row} in a row, abort at {config.max_consecutive_nonfinite})")
        else:
            self._nonfinite_in_a_row = 0
            self._committing = True  # the weights now move to the next step: a second signal must wait
            self.optimizer.step()
        with warnings.catch_warnings():  # a skipped first step makes torch warn that the order looks wrong
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
        self.global_step += 1
        return grad_norm

    # ------------------------------------------------------------------------------------------------
    # metrics

    def _metrics(self, batch: Batch, rollout_stats: dict, update_stats: dict, started, generated_at, finished):
        config = self.config
        rewards = self.dist.gather(torch.cat(rollout_stats["scores"]))  # (N_total,)
        valid = self.dist.gather(torch.cat(rollout_stats["valid"]))  # (N_total,)
        group_std = group_reward_std(rewards, config.group_size, valid)  # (groups,)
        lengths = self.dist.gather(torch.cat([r.completion_lengths for r in batch.rollouts]).float())
        truncated = self.dist.gather(torch.cat([r.truncated for r in batch.rollouts]).float())
        errors, timeouts, nonfinite = self.dist.sum(
            [rollout_stats["errors"], rollout_stats["timeouts"], rollout_stats["nonfinite"]])
        gen_seconds = self.dist.max(rollout_stats["gen_seconds"])  # the ranks generate side by side
        elapsed = finished - started
        metrics = {
            "loss": update_stats["loss"],
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "kl": update_stats["kl"],
            "clip_frac": update_stats["clip_frac"],
            "clip_frac_low": update_stats["clip_frac_low"],
            "clip_frac_high": update_stats["clip_frac_high"],
            "ratio_mean": update_stats["ratio_mean"],
            "grad_norm": update_stats["grad_norm"],
            "learning_rate": update_stats["learning_rate"],
            "group_reward_std_mean": float(group_std.mean()),
            "frac_zero_std_groups": float((group_std == 0).float().mean()),
            "completion_length/mean": float(lengths.mean()),
            "completion_length/min": float(lengths.min()),
            "completion_length/max": float(lengths.max()),
            "frac_truncated": float(truncated.mean()),
            "tokens_per_second": float(lengths.sum()) / max(gen_seconds, 1e-9),
            "step_seconds": elapsed,
            "generation_share": gen_seconds / max(elapsed, 1e-9),
            "rewards/errors": int(errors),
            "rewards/timeouts": int(timeouts),
            "rewards/nonfinite": int(nonfinite),
            "skipped_steps": self._skipped_steps,
            "param_delta_norm": self._param_delta_norm(),
        }
        for name, parts in rollout_stats["components"].items():
            metrics[f"rewards/{name}"] = float(self.dist.gather(torch.cat(parts)).mean())
        metrics["_samples"] = self._gathered_samples(rollout_stats["samples"], len(batch.rollouts))
        if metrics["frac_zero_std_groups"] > 0.75 and not self._warned_zero_std and self.dist.is_main:
            self._warned_zero_std = True
            warnings.warn(
                f"{metrics['frac_zero_std_groups']:.0%} of groups have identical rewards, so they carry no "
                "learning signal. Likely causes: the task is too hard or too easy for the model (screen the "
                "prompts: `forge screen`), max_new_tokens cuts answers off, or the reward is too coarse.",
                stacklevel=2)
        return metrics

    def _gathered_samples(self, samples: list[dict], num_rollouts: int) -> list[dict]:
        """The first log_completions samples of the step in prompt order, taken from every rank's share."""
        every_rank = self.dist.gather_objects(samples)  # each: `share` samples per rollout batch
        share = len(samples) // max(num_rollouts, 1)
        ordered = [sample for r in range(num_rollouts) for rank_samples in every_rank
                   for sample in rank_samples[r * share:(r + 1) * share]]
        return ordered[: self.config.log_completions]

    def _samples(self, rows, rollout: Rollout, rewards: torch.Tensor) -> list[dict]:
        group = self.config.group_size
        out = []
        for i, text in enumerate(rollout.completions):
            row = rows[i // group]
            out.append({"prompt": row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"],
                        "reference": row.get("reference"), "completion": text, "reward": float(rewards[i])})
        return out[::group]  # one completion per prompt

    @torch.no_grad()
    def _param_delta_norm(self) -> float:
        total = 0.0
        for p, p0 in zip(self.trainable, self.initial_params):
            total += float((p.detach().cpu().float() - p0.float()).pow(2).sum())
        return math.sqrt(total)

    # ------------------------------------------------------------------------------------------------
    # evaluation, checkpoints, signals, input checks

    def _evaluate(self, eval_rows: list[dict], epoch: int) -> None:
        from forge.eval.evaluate import evaluate

        result = evaluate(self.model, self.tokenizer, eval_rows, max_new_tokens=self.config.max_new_tokens,
                          max_prompt_length=self.max_prompt_length)
        self.logger.log({f"eval/{k}": v for k, v in result.metrics.items()}, step=self.global_step, epoch=epoch)

    def _run_config(self) -> dict:
        """The config as saved with checkpoints and compared on resume: GRPOConfig plus the model's name."""
        return {**self.config.to_dict(), "model_name": getattr(self.model.config, "_name_or_path", "") or ""}

    def _save(self, path: Path, epoch: int, position: int, rng_state: dict | None = None) -> None:
        from forge import checkpoint as ckpt

        state = {"global_step": self.global_step, "epoch": epoch, "position": position,
                 "nonfinite_in_a_row": self._nonfinite_in_a_row, "skipped_steps": self._skipped_steps,
                 "model_name": self._run_config()["model_name"], "is_lora": self.is_lora, **self._dataset_identity}
        ckpt.save_checkpoint(path, model=self.model, tokenizer=self.tokenizer, optimizer=self.optimizer,
                             scheduler=self.scheduler, trainer_state=state, config=self._run_config(),
                             rng_state=rng_state)
        if path.name != "final":
            self._saved = (self.global_step, path)
            ckpt.prune_checkpoints(path.parent, self.config.save_total_limit)

    def _checkpoint_of_last_step(self) -> Path | None:
        """A checkpoint of the last finished step, written now if this run has none; None before step 1.

        Only called when no optimizer step is under way, so the weights, optimizer and schedule are still
        those of that step; its RNG state was captured when it finished."""
        last = self._last_finished
        if last is None or last.step == 0 or self.global_step != last.step or self._committing:
            return None
        if self._saved is not None and self._saved[0] == last.step:
            return self._saved[1]
        path = Path(self.config.output_dir) / str(last.step)
        if self.dist.is_main:
            self._save(path, last.epoch, last.position, rng_state=last.rng_state)
        return path

    @staticmethod
    def _resume_hint(path: Path) -> str:
        return (f"Resume with the same command plus --resume (`forge train ... --resume`), or in Python with "
                f"GRPOConfig(..., resume_from={str(path)!r}).")

    def _where_to_resume(self) -> str:
        """Save the last finished step if needed; say where it is and how to resume."""
        path = self._checkpoint_of_last_step()
        if path is not None:
            return f"The last finished step ({self._last_finished.step}) is saved in {path}. {self._resume_hint(path)}"
        if self._saved is not None:
            return f"The newest checkpoint is {self._saved[1]}. {self._resume_hint(self._saved[1])}"
        return "No optimizer step had finished, so there is no checkpoint: start the run again."

    def _interrupted_message(self, abandoned: bool) -> str:
        name = signal.Signals(self._stop_signal).name if self._stop_signal else "a signal"
        if abandoned:
            head = f"stopped by a second {name}; step {self.global_step + 1} was abandoned."
        else:
            head = f"stopped by {name} after step {self.global_step} of {self.total_steps}."
        return f"{head} {self._where_to_resume()}"

    def _resume(self, where: str) -> tuple[int, int]:
        from forge import checkpoint as ckpt

        path = ckpt.latest_checkpoint(Path(self.config.output_dir)) if where == "latest" else Path(where)
        if path is None:
            raise FileNotFoundError(f"resume_from='latest' but {self.config.output_dir} holds no complete checkpoint")
        state = ckpt.load_checkpoint(path)
        ckpt.check_compatible(state.config, self._run_config(), checkpoint_path=path)
        self._check_same_dataset(state.trainer_state, path)
        ckpt.load_model_weights(self.model, path)
        self.optimizer.load_state_dict(state.optimizer_state)
        self.scheduler.load_state_dict(state.scheduler_state)
        ckpt.restore_rng_state(state.rng_state)
        self.global_step = int(state.trainer_state["global_step"])
        self._nonfinite_in_a_row = int(state.trainer_state.get("nonfinite_in_a_row", 0))
        self._skipped_steps = int(state.trainer_state.get("skipped_steps", 0))
        self._saved = (self.global_step, path)
        newer = [str(p) for step, p in ckpt.numbered_checkpoints(self.config.output_dir) if step > self.global_step]
        if newer:
            warnings.warn(f"resuming from step {self.global_step} while {self.config.output_dir} holds later "
                          f"checkpoints {newer} of the earlier run; this run replaces each as it reaches its step, "
                          f"until then resume_from='latest' would pick them", stacklevel=3)
        return int(state.trainer_state["epoch"]), int(state.trainer_state["position"])

    def _check_same_dataset(self, saved_state: dict, path: Path) -> None:
        """The saved (epoch, position) only means something on the same rows: refuse another size, warn on edits."""
        saved_size, size = saved_state.get("dataset_size"), self._dataset_identity.get("dataset_size")
        if saved_size is not None and saved_size != size:
            raise ValueError(
                f"cannot resume from checkpoint {path}: it was trained on a dataset of {saved_size} rows, this run "
                f"has {size}. Resuming would skip or repeat rows; pass the same dataset (and --max_samples), or "
                f"start a fresh run in a new output_dir.")
        if saved_state.get("dataset_fingerprint") not in (None, self._dataset_identity.get("dataset_fingerprint")):
            warnings.warn(f"the dataset's contents changed since checkpoint {path} was saved (same number of rows); "
                          f"resuming at its position anyway", stacklevel=3)

    def _install_signal_handlers(self) -> dict:
        if not hasattr(signal, "SIGTERM") or threading_is_not_main():
            return {}

        def request_stop(signum, frame):
            if self._stop_signal is not None and not self._committing:
                raise KeyboardInterrupt  # second signal: abandon the step under way (weights untouched)
            self._stop_signal = signum
            tqdm.write(f"forge: {signal.Signals(signum).name} received; finishing step {self.global_step + 1}, "
                       f"then saving a checkpoint (send it again to abandon the step and stop sooner)")

        return {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signal_handlers(previous: dict) -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    def _prompt_budget(self) -> int:
        limit = getattr(self.model.config, "max_position_embeddings", None) or 10**9
        room = limit - self.config.max_new_tokens
        if self.config.max_prompt_length is not None:
            if self.config.max_prompt_length > room:
                raise ValueError(
                    f"max_prompt_length={self.config.max_prompt_length} + max_new_tokens={self.config.max_new_tokens}"
                    f" exceeds the model's context of {limit} tokens; lower one of them")
            return self.config.max_prompt_length
        if room < 1:
            raise ValueError(f"max_new_tokens={self.config.max_new_tokens} leaves no room for a prompt in the "
                             f"model's context of {limit} tokens")
        return room

    def _check_prompt_lengths(self, rows: list[dict]) -> None:
        """Tokenize every prompt once up front, so an over-long one fails before any training."""
        from forge.core.rollout import tokenize_prompts

        for start in range(0, len(rows), 64):
            chunk = rows[start:start + 64]
            try:
                tokenize_prompts(self.tokenizer, [r["prompt"] for r in chunk], self.max_prompt_length,
                                 self.config.truncate_prompts)
            except ValueError as error:
                raise ValueError(f"dataset rows {start}..{start + len(chunk) - 1}: {error}") from None

    def _check_output_dir(self, output_dir: Path) -> None:
        if output_dir.exists() and not output_dir.is_dir():
            raise ValueError(f"output_dir={str(output_dir)!r} is a file; choose a directory path")
        if self.dist.is_main:
            try:
                output_dir.mkdir(parents=True, exist_ok=True)
                probe = output_dir / ".forge_write_test"
                probe.write_text("ok")
                probe.unlink()
            except OSError as error:
                raise ValueError(f"output_dir={str(output_dir)!r} is not writable ({error}); choose another") from None


def _sampling_seed(seed: int, step: int) -> int:
    """The seed of an optimizer step's sampling noise: a hash of (seed, step), the same on every rank."""
    return int.from_bytes(hashlib.sha256(f"forge-sampling:{seed}:{step}".encode()).digest()[:8], "little")


def _dataset_identity(rows: list[dict]) -> dict:
    """Size and content hash of the training rows, saved with checkpoints to catch a resume on other data."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return {"dataset_size": len(rows), "dataset_fingerprint": digest.hexdigest()[:16]}


def _reached(step: int, every: int, stride: int) -> bool:
    """Whether the last `stride` optimizer steps (the updates of one rollout) reached or passed a multiple of
    `every` (0 = never); with stride 1 this is step % every == 0."""
    return every > 0 and step // every > (step - stride) // every


def threading_is_not_main() -> bool:
    import threading

    return threading.current_thread() is not threading.main_thread()


def _make_scheduler(optimizer, config: GRPOConfig, total_steps: int):
    warmup = int(config.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        if config.lr_scheduler == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if config.lr_scheduler == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


__all__ = ["GRPOTrainer", "RewardError", "TrainingInterrupted", "seed_everything"]
