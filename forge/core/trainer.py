"""GRPOTrainer: one GRPO optimizer step as a recipe, with each phase a public method.

    step(rows)
      collect(rows)    generate G completions per prompt (dynamic_sampling: in rounds) -> score -> advantages
                       -> loss mask -> pi_old and reference log-probs -> a teacher's per-token advantages
      cut(batch)       rollout_slices > 1: the rollout's optimizer steps, each on a slice of its completions
      update(batch)    clipped-ratio loss + KL over micro-batches, backward -> clip, AdamW, schedule (once per
                       slice, num_iterations times over)
      metrics          forge/run/step_stats.py, from statistics combined over the processes
    train(dataset)     the loop around the steps (forge/run/loop.py): schedule, logs, evaluation, checkpoints

The only module that talks to the processes (`self.dist`): each rank generates and scores whole groups of its
share of the prompts and the gradients are summed; the sampling noise of a step is drawn for the whole batch
and split like the prompts, so 1 and N processes give the same update, up to fp32 rounding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from forge.core.arguments import trainer_arguments
from forge.core.batch import Batch
from forge.core.config import GRPOConfig
from forge.core.dynamic_sampling import SamplingRounds
from forge.core.engine_rollout import generate_on_engine, open_engine
from forge.core.evaluator import greedy_reward_evaluator
from forge.core.grpo import LossNormaliser, LossSettings, group_reward_std, grpo_loss, multi_reward_advantages
from forge.core.logprobs import PolicyLogprobs, checkpointed_layers, logit_head, micro_batches
from forge.core.preflight import check_before_training, run_preflight
from forge.core.reward import TrainerState
from forge.core.reward_sources import build_reward_list
from forge.core.rollout import (
    Rollout,
    SamplingSettings,
    generate,
    prompt_budget,
    sampling_noise,
    sampling_seed,
)
from forge.core.rollout_slices import cut_rollout, slice_seed
from forge.core.rollout_worker import AsyncRollouts
from forge.core.scoring import RewardError, Scores, score_rollout
from forge.core.teacher import open_teacher
from forge.envs import env_rewards, rollout_tools
from forge.model import prepare_policy
from forge.model.decode_plan import DecodePlan
from forge.parallel.distributed import DataParallel
from forge.run import step_stats
from forge.run.loop import TrainingRun
from forge.run.optim import GuardedStep, advance_schedule
from forge.run.rng import seed_everything
from forge.run.signals import StopSignals, TrainingInterrupted
from forge.run.trainer_surface import RunEvents, TrainerSurface, with_resume


class GRPOTrainer(TrainerSurface, PolicyLogprobs):
    """GRPO fine-tuning of a HuggingFace causal LM.

    model:     a PreTrainedModel (or PeftModel), or a hub id / local path / "default" that Forge loads
    tokenizer: its tokenizer (None when model is a name)
    reward_fn: a BaseReward, a plain f(prompts, completions, **kwargs) -> list[float], or a list of them
    config:    GRPOConfig
    evaluator: what train(eval_dataset=...) measures; None: greedy completions' mean reward (eval/reward)
    tools:     typed, docstringed functions the policy may call during rollouts (forge/tools); their result
               tokens are context, not actions; environment_factory: an environment class (forge/envs)
    TRL's keywords work too (docs/from-trl.md): reward_funcs= (called the TRL way), args=, train_dataset=,
    eval_dataset=, processing_class=, peft_config= (a LoraConfig), callbacks= (forge/run/trainer_surface.py).
    """

    def __init__(self, model, tokenizer=None, reward_fn=None, config: GRPOConfig | None = None,
                 evaluator: Callable[..., dict] | None = None, tools: list[Callable] | None = None, *,
                 reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 peft_config=None, environment_factory=None, callbacks=None, teacher_model=None):
        tokenizer, reward_fn, config, convention = trainer_arguments(
            tokenizer, reward_fn, config, reward_funcs=reward_funcs, args=args,
            processing_class=processing_class, peft_config=peft_config)
        self.config = config = config.validate()
        rewards, weights = env_rewards(reward_fn, environment_factory, config.reward_weights)  # + env's own
        self.rewards = build_reward_list(rewards, weights, convention)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.dist = DataParallel(fsdp=config.fsdp)  # one process: a OneProcess, its collectives no-ops
        ready = prepare_policy(model, tokenizer, config, device=self.dist.device, seed=seed_everything,
                               sync=self.dist.broadcast_from_main, announce=self.dist.is_main,
                               shard=self.dist.shard if self.dist.fsdp else None, peft_config=peft_config)
        self.model = model = ready.model
        self.tokenizer, self.reference_model, self.is_lora = ready.tokenizer, ready.reference, ready.is_lora
        self.precision, self.trainable, self.device = ready.precision, ready.trainable, ready.device
        self.loss_autocast = self.precision.reusable_autocast(model)  # the loss pass's, built once
        with self.loss_autocast:  # whether the loss pass makes logits from the hidden states, checked once
            logit_head(model)
        self.teacher = open_teacher(config, model, self.tokenizer, teacher_model)  # or None
        self.rewards_teach = self.teacher is None or config.reward_coef > 0  # False: pure distillation
        # The run's tools, or its environment (with those tools too); None: neither.
        self.tool_settings = rollout_tools(tools, environment_factory, config, self.tokenizer)
        self.engine = open_engine(config, model, self.tokenizer, self.precision.compute, self.dist)  # or None
        with self.precision.autocast(model):  # how Forge's own decode runs, decided once
            self.decode_plan = None if self.engine else DecodePlan.of(
                model, config.generation_backend, self.tool_settings is not None, self.precision,
                merge_lora=config.merge_lora_for_generation and not self.dist.fsdp)
        self.evaluator = evaluator or greedy_reward_evaluator(self.rewards, config, self.tool_settings,
                                                              self.engine)
        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.guard = GuardedStep(self.trainable, self.optimizer, config.max_grad_norm,
                                 config.max_consecutive_nonfinite, any_rank=self.dist.any,
                                 scale_loss=self.precision.compute == torch.float16)
        # theta_0, for the distance the weights moved from it (FSDP2: this rank's shards)
        self.initial_params = [p.detach().cpu().clone() for p in self.dist.local_shards(self.trainable)]
        self.sampling_rng = torch.Generator().manual_seed(sampling_seed(config.seed, 0))  # reseeded each step
        self.signals = StopSignals(next_step=lambda: self.global_step + 1,
                                   committing=lambda: self.guard.committing)
        self.entropy_control = config.entropy_control  # the entropy coefficient (adaptive: adapted each step)
        prompt_budget(model.config, config.max_new_tokens, config.max_prompt_length)  # refuses no room
        self.global_step, self.total_steps, self.rows_per_step = 0, config.max_steps, 0  # reset by train()
        self.scheduler = self.prompt_pool = None  # set by train(): the schedule, the rows (dynamic sampling)
        auto = config.micro_batch_size == "auto"  # one group per pass until the preflight fits max_memory_mb
        self.micro_batch_size = config.group_size if auto else config.micro_batch_size
        self.events = RunEvents(callbacks, config, model, self.tokenizer, self.optimizer,
                                is_main=self.dist.is_main)
        # async GRPO's rollout worker, or None
        self.ahead = AsyncRollouts.of_run(config, self.dist.world_size, self.tool_settings)

    def train(self, dataset: Any = None, eval_dataset: Any = None,
              resume_from_checkpoint: bool | str | None = None):
        """Run GRPO over `dataset` (rows {"prompt", ...}, a HF Dataset or a JSONL path; default:
        train_dataset); resume_from_checkpoint (TRL's): True = the newest checkpoint in output_dir, or a
        checkpoint's path."""
        self.config = with_resume(self.config, resume_from_checkpoint)
        run = TrainingRun(self, self.train_dataset if dataset is None else dataset,
                          self.eval_dataset if eval_dataset is None else eval_dataset,
                          partial(check_before_training, self), partial(run_preflight, self))
        self.prompt_pool = run.rows  # where dynamic sampling draws more prompts from
        return run.run()

    def step(self, rows: list[dict]) -> dict:
        """One optimizer step on these dataset rows (num_iterations x rollout_slices of them when more)."""
        self.model.eval()  # dropout off: sampling, pi_old, pi_theta and the reference see the same network
        started = time.perf_counter()
        batch, stats = self.collect(rows)
        slices = [batch] if self.config.rollout_slices == 1 else self.cut(batch)  # each an optimizer step's
        updates = [self.update(part) for _ in range(self.config.num_iterations) for part in slices]
        stats = self.dist.combined(stats)  # every rank's share: the metrics are of the whole batch
        group_std = group_reward_std(torch.cat(stats.scores), self.config.group_size, torch.cat(stats.valid))
        squared = step_stats.squared_param_delta(self.dist.local_shards(self.trainable), self.initial_params)
        delta_norm = math.sqrt(self.dist.sum_shards([squared])[0])  # ||theta - theta_0||
        samples = self.dist.gather_objects(stats.samples)  # every rank's, in rank order
        metrics = step_stats.step_metrics(stats, updates[0], group_std=group_std,
                                          seconds=time.perf_counter() - started,
                                          skipped_steps=self.guard.skipped_steps, param_delta_norm=delta_norm,
                                          engine=self.engine, ahead=self.ahead)
        metrics["_later_updates"] = updates[1:]  # each later optimizer step's own row (iterations, slices)
        metrics["_samples"] = step_stats.ordered_samples(samples, len(batch.rollouts),
                                                         self.config.log_completions)
        return metrics

    def collect(self, rows: list[dict]) -> tuple[Batch, step_stats.RolloutStats]:
        """Generate, score and compute advantages for every rollout of this step (this rank's share)."""
        config, dist = self.config, self.dist
        group, per = config.group_size, config.prompts_per_step
        batch, stats = Batch(), step_stats.RolloutStats()
        self.sampling_rng.manual_seed(sampling_seed(config.seed, self.global_step))
        selects = config.drop_zero_std_groups or config.dynamic_sampling  # flat groups leave the loss
        rounds = SamplingRounds.of_step(config, rows, self.prompt_pool, self.sampling_rng, stats.sampling) \
            if selects else [rows[start:start + per] for start in range(0, len(rows), per)]
        for round_rows in rounds:  # the step's rows (dynamic_sampling: more, until enough groups differ)
            mine = dist.my_share(round_rows, per)  # each rank: whole groups
            started = time.perf_counter()
            rollout = self.sample_completions([row["prompt"] for row in mine], mine)
            stats.gen_seconds += time.perf_counter() - started
            scores = self.score(mine, rollout)
            # Advantages of the whole rollout batch (scale_rewards='batch' needs every rank's rewards), then
            # ours. NaN/inf rewards and samples no reward applies to are masked, out of the group statistics.
            components, applies = scores.stacked()  # (N, K) each
            advantages = multi_reward_advantages(
                dist.gather(components), dist.gather(applies), [w for _, _, w in self.rewards], group,
                config.scale_rewards, config.advantage_epsilon, config.multi_objective_aggregation,
                valid=dist.gather(scores.valid))  # (all ranks' N,)
            advantages = dist.my_share(advantages, per, group)  # (N,)
            keep = scores.valid & ~(rollout.truncated & config.mask_truncated_completions)  # (N,)
            if selects:
                informative = group_reward_std(scores.total, group, scores.valid & scores.scored) > 0  # (P,)
                taken = rounds.take(dist.gather(informative)).repeat_interleave(group)  # (all ranks' N,)
                keep &= dist.my_share(taken, per, group)
            batch.rollouts.append(rollout)
            batch.rows.append(mine)
            batch.advantages.append(advantages)
            batch.loss_mask.append(rollout.sampled_mask * keep[:, None].long())  # (N, T), no tool results
            stats.add(rollout, scores, mine)
        batch.loss_indices = [self.dist.loss_indices(mask) for mask in batch.loss_mask]
        passes = list(zip(batch.rollouts, batch.loss_indices))  # those without a loss token need no pass
        batch.old_logprobs = [self.old_logprobs(rollout, indices) for rollout, indices in passes]
        batch.ref_logprobs = [self.reference_logprobs(rollout, indices) for rollout, indices in passes]
        if self.teacher is not None:  # on-policy distillation: per-token advantages (N, T)
            batch.advantages = self.teacher.advantages(batch, self, stats)
        return batch, stats

    def cut(self, batch: Batch) -> list[Batch]:
        """rollout_slices > 1: the rollout's optimizer steps, each on a slice of its completions, shuffled by
        this rollout's seed over every rank's completions (core/rollout_slices.py); the later slices' ratio is
        taken against pi_old, the policy that sampled them."""
        config, dist = self.config, self.dist  # num_iterations > 1: collect has computed pi_old
        recompute_old = partial(self.rollout_logprobs, self.model) if config.num_iterations == 1 else None
        shuffle = torch.Generator().manual_seed(slice_seed(config.seed, self.global_step))
        mine = partial(dist.my_share, per_round=config.prompts_per_step, group=config.group_size)
        return cut_rollout(batch, config.rollout_slices, shuffle, config.max_new_tokens, mine, total=dist.sum,
                           recompute_old=recompute_old)

    def sample_completions(self, prompts: list, rows: list[dict] | None = None) -> Rollout:
        """G completions per prompt, with this step's sampling noise (and the run's tools, or its environments
        reset with the prompts' dataset `rows`)."""
        if self.ahead is not None and self.ahead.running:  # async GRPO: sampled earlier, by the worker
            return self.ahead.take(self.global_step, prompts)
        budget = self.max_prompt_length  # as the config stands, as are the sampling settings
        config, settings = self.config, SamplingSettings.from_config(self.config)
        noise = sampling_noise(self.sampling_rng, len(prompts) * config.group_size, settings.max_new_tokens,
                               self.dist.rank, self.dist.world_size)
        if self.engine is not None:  # vLLM samples its own copy of the weights (forge/core/engine_rollout.py)
            self.engine.sync(self.model, self.global_step)
            return generate_on_engine(self.engine, self.tokenizer, prompts, config.group_size, settings,
                                      budget, config.truncate_prompts, noise, self.tool_settings, rows)
        with self.dist.whole_weights(self.model):  # FSDP2: gathered; the plan's precision and merged LoRA
            return generate(self.model, self.tokenizer, prompts, config.group_size, settings, budget,
                            config.truncate_prompts, config.share_prompt_prefix, noise, self.tool_settings,
                            rows=rows, plan=self.decode_plan)

    def score(self, rows: list[dict], rollout: Rollout) -> Scores:
        """Score this rank's rollout; when a reward fails on any rank, every rank raises RewardError here, so
        all of them stop at the same point and rank 0 can save the last finished step (forge/run/loop.py)."""
        step = self.global_step + 1
        state = TrainerState(self.global_step, self.total_steps, self.device)
        scores, failure = score_rollout(self.rewards, rows, rollout, self.config, step=step,
                                        trainer_state=state)
        if self.dist.any(failure is not None):
            raise failure or RewardError(f"step {step}: a reward failed in another process; see its error")
        return scores

    def update(self, batch: Batch) -> dict:
        """Loss and backward over the micro-batches of all rollouts (a slice: its normaliser), then a step."""
        # Counted over every rank, so each rank's loss is its share of the one loss of the whole batch.
        counts = self.dist.sum(LossNormaliser.counts(batch.loss_mask))
        normaliser = batch.normaliser or LossNormaliser.of(counts, self.config.max_new_tokens)
        totals = step_stats.UpdateTotals()
        self.optimizer.zero_grad(set_to_none=True)
        with self.dist.kept_until_backward(self.model):  # FSDP2: one gather per unit
            for r, rollout in enumerate(batch.rollouts):
                for indices in micro_batches(rollout, self.micro_batch_size, batch.loss_indices[r]):
                    self.loss_and_backward(batch, r, indices, normaliser, totals)
        self.dist.all_reduce_grads(self.trainable)
        shards = self.dist.local_shards(self.trainable)  # this process's part of each weight (FSDP2: shards)
        update = self.dist.combined(totals).as_metrics(with_rollout_is=self.config.rollout_is != "none")
        update["learning_rate"] = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        # Clip and step: GuardedStep skips a step whose loss, gradient or new weights (`shards`) are NaN/inf.
        update["grad_norm"] = self.guard.step(math.isfinite(update["loss"]), self.global_step + 1, shards,
                                              announce=self.dist.is_main)
        advance_schedule(self.scheduler)
        self.global_step += 1
        if self.ahead is not None:  # async GRPO: the weights for the steps the worker samples next
            self.ahead.publish(self.global_step, self.trainable)
        update["entropy_coef"] = self.entropy_control.applied  # the coefficient this step's loss used
        self.entropy_control = self.entropy_control.observed(update.get("entropy"))
        return update

    def loss_and_backward(self, batch: Batch, r: int, indices: torch.Tensor, normaliser: LossNormaliser,
                          totals: step_stats.UpdateTotals) -> None:
        """The loss of one micro-batch (rollout r's rows `indices`) and its backward; gradients accumulate."""
        config, rollout, mask = self.config, batch.rollouts[r], batch.loss_mask[r][indices]
        settings = LossSettings.from_config(config, entropy_coef=self.entropy_control.applied)
        with checkpointed_layers(self.model, config.gradient_checkpointing):  # layers recomputed in backward
            logprobs, entropy, *divergence = self.logprobs(  # (n, T') each; divergence: distill_loss='full'
                self.model, rollout, indices, with_entropy=True, entropy_grad=settings.entropy_coef != 0,
                teacher=self.teacher and self.teacher.view(batch, r, indices))
        length = logprobs.shape[1]
        old, ref, sampler = (None if t is None else t[indices, :length].to(self.device)  # (n, T') each
                             for t in (batch.old_logprobs[r], batch.ref_logprobs[r],
                                       rollout.sampler_logprobs))
        part_mask = mask[:, :length].to(self.device)
        loss, stats = grpo_loss(logprobs, old, ref, batch.advantages[r][indices].to(self.device), part_mask,
                                settings=settings, normaliser=normaliser, entropy=entropy,
                                sampler_logprobs=sampler)
        if divergence:  # full-vocabulary distillation: the teacher's term (core/distill.py)
            loss = loss + self.teacher.loss(divergence[0], part_mask, normaliser.num_tokens, totals)
        # Each rank's loss carries its share: the sum of the ranks' gradients is the whole loss's gradient.
        (loss * self.guard.loss_scale).backward()  # the scale is 1 but under fp16 (forge/run/optim.py)
        recomputed = old is not None and batch.old_logprobs[r] is not rollout.sampler_logprobs
        ours = old if recomputed else logprobs  # pi_old where collect recomputed it, else this pass's
        gap = None if sampler is None else step_stats.logprob_gap(ours, sampler, part_mask)
        totals.add(loss, stats, float(mask.sum()), gap)

    @property
    def max_prompt_length(self) -> int:  # max_prompt_length, or the context left after max_new_tokens
        return prompt_budget(self.model.config, self.config.max_new_tokens, self.config.max_prompt_length)


__all__ = ["Batch", "GRPOTrainer", "RewardError", "TrainingInterrupted", "seed_everything"]
