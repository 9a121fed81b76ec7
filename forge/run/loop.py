"""The run around the steps: how many, when to log, evaluate and save, and what a stop or a failure says.

    TrainingRun(trainer, dataset, eval_dataset, check_rows, preflight).run()
        load and check the rows; claim output_dir (a lock held until the run ends)
        resume (weights, optimizer, schedule, RNG, data position)     -> forge/run/lifecycle.py
        a new run: preflight(rows, total_steps)                        -> core/preflight.py
        for each step's rows:  trainer.step(rows)                      -> the GRPO step (core/trainer.py)
            log every logging_steps (with the run-health keys, forge/run/health.py), evaluate every
            eval_steps, save every save_steps; a run-health alarm in stop_on_health stops the run
            the callbacks hear each event and may ask to log, evaluate, save or stop
                                                                                -> run/trainer_surface.py
            a config a callback changed is checked as at start-up before it is used   -> run/config_watch.py
            a signal: finish the step, save it, raise TrainingInterrupted
        a failed step (StepFailed: a reward, non-finite losses, a config a callback broke): say where the last
            finished step is saved
        save final/, evaluate, close the logs; return a TrainResult (run/trainer_surface.py)

The trainer is given, not imported: anything with the attributes read below runs here (`config`, `dist`,
`model`, `tokenizer`, `optimizer`, `scheduler`, `is_lora`, `reference_model`, `guard`, `signals`,
`global_step`, `events` (a RunEvents), and the methods `step(rows) -> metrics`, `evaluate(rows) -> metrics`),
and `ahead`: None, or async GRPO's rollout worker, which `ahead.schedule(steps, trainer)` starts and feeds
(forge/core/rollout_worker.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from forge.data.dataset import checked_rows, iterate_steps, rows_per_step, training_rows
from forge.logging.logger import ForgeLogger, install_warning_format
from forge.model.vllm_engine import drop_pushed_weights
from forge.run import memory
from forge.run.config_watch import ConfigWatch
from forge.run.health import HEALTH_RULES, REWARD_RULES, HealthMonitor, parse_thresholds
from forge.run.lifecycle import CheckpointParts, FinishedStep, RunLifecycle, claim_output_dir
from forge.run.optim import make_scheduler
from forge.run.rng import capture_rng_state, seed_everything
from forge.run.signals import TrainingInterrupted
from forge.run.step_stats import warn_if_mostly_flat, warn_if_tools_unused
from forge.run.trainer_surface import TrainResult


class StepFailed(RuntimeError):
    """A step failed at a point every process reaches together (a reward, a run of non-finite steps): the
    weights are still those of the last finished step, which is saved before this is raised to the caller."""


class HealthStop(StepFailed):
    """A run-health alarm named in stop_on_health went off; the step it went off at is saved."""


class ConfigRefused(StepFailed):
    """A callback changed the config between steps to what the run refuses (forge/run/config_watch.py); the
    last finished step is saved."""


def reached(step: int, every: int, stride: int) -> bool:
    """Whether the last `stride` optimizer steps (the updates of one rollout: num_iterations x rollout_slices)
    reached or passed a multiple of `every` (0 = never); with stride 1 this is step % every == 0. Checkpoints
    and evaluations so land between rollouts, never between the slices of one."""
    return every > 0 and step // every > (step - stride) // every


def run_config(trainer) -> dict:
    """The config as saved with checkpoints and compared on resume: GRPOConfig plus the model's name."""
    return {**trainer.config.to_dict(),
            "model_name": getattr(trainer.model.config, "_name_or_path", "") or ""}


class TrainingRun:
    """One call of GRPOTrainer.train: the loop over the steps and everything around it."""

    def __init__(self, trainer, dataset, eval_dataset, check_rows: Callable[[list[dict]], None],
                 preflight: Callable[[list[dict], int], object] | None = None):
        """Load and check everything the run reads (rows, eval rows, and `check_rows`), before any step."""
        config, dist = trainer.config, trainer.dist
        self.trainer, self.config, self.dist, self.events = trainer, config, dist, trainer.events
        self.rows, self.identity = training_rows(dataset)
        trainer.rows_per_step = rows_per_step(len(self.rows), config.prompts_per_step,
                                              config.prompts_per_optimizer_step)
        self.eval_rows = None if eval_dataset is None else checked_rows(eval_dataset)
        if config.prompts_per_step % dist.world_size:
            raise ValueError(f"prompts_per_step={config.prompts_per_step} must be divisible by the number of "
                             f"processes ({dist.world_size}) so every rank gets whole groups")
        check_rows(self.rows)
        self.preflight = preflight
        # optimizer steps: num_iterations x rollout_slices per rollout
        steps_per_epoch = len(self.rows) // trainer.rows_per_step * config.updates_per_rollout
        self.total_steps = (config.max_steps if config.max_steps > 0
                            else steps_per_epoch * config.num_train_epochs)
        self.lifecycle: RunLifecycle | None = None
        self.logger: ForgeLogger | None = None
        # False: pure distillation (no flat-group alarms)
        rewards_teach = getattr(trainer, "rewards_teach", True)
        self.warned_flat = not rewards_teach  # "most groups carry no signal" is said once per run
        self.health = HealthMonitor(config.health_window, parse_thresholds(config.health_thresholds),
                                    off=() if rewards_teach else REWARD_RULES)
        self.alarms: list[str] = []  # the alarms of the last step that stop the run (stop_on_health)
        # steps with tools in which no completion called one; None: a call was seen, or the warning was given
        self.rollouts_without_calls: int | None = 0
        self.config_watch = ConfigWatch(config,
                                        has_reference=trainer.is_lora or trainer.reference_model is not None)
        self.losses: list[float] = []  # each optimizer step's loss in this run, for train_loss

    def run(self) -> TrainResult:
        """Claim output_dir (its lock is held until the run ends), then train."""
        install_warning_format()  # Forge's warnings as one line each
        config = self.config
        lock = claim_output_dir(Path(config.output_dir), resuming=bool(config.resume_from),
                                overwrite=config.overwrite_output_dir, is_main=self.dist.is_main)
        try:
            return self.train()
        finally:
            if lock is not None:
                lock.release()

    def train(self) -> TrainResult:
        config, started = self.config, time.perf_counter()
        epoch, position = self.begin()
        epoch, position = self.run_steps(epoch, position)
        self.lifecycle.save(self.finished(epoch, position), name="final")  # rank 0 (FSDP2: every rank)
        self.dist.barrier()
        if self.eval_rows is not None and not reached(self.trainer.global_step, config.eval_steps,
                                                      config.updates_per_rollout):
            self.evaluate(epoch)
        if self.dist.is_main and config.generation_backend == "vllm" and config.vllm_mode == "server":
            drop_pushed_weights(config.output_dir)  # the server's copy: final/ holds the model
        summary, epoch = self.train_summary(started), self.events.state.epoch or 0
        self.logger.log(summary, self.trainer.global_step, epoch, to_file=False)  # the console, the trackers
        self.events.log(summary, self.trainer.global_step, epoch)  # state.log_history, on_log
        self.events.train_end()
        self.logger.close()
        return TrainResult(self.trainer.global_step, {**summary, "epoch": epoch})

    def begin(self) -> tuple[int, int]:
        """Before the first step: the schedule, the checkpoints, the seed, then resume (or a new run's
        preflight), the logs, and the callbacks' train_begin. Returns where the data starts: (epoch,
        position)."""
        config, trainer = self.config, self.trainer
        trainer.total_steps = self.total_steps  # rewards see it through TrainerState
        memory.return_freed_memory()  # a loss pass's freed logit chunks go back to the system
        trainer.scheduler = make_scheduler(trainer.optimizer, config.lr_scheduler, config.warmup_ratio,
                                           self.total_steps)
        self.lifecycle = RunLifecycle(config.output_dir, CheckpointParts(
            trainer.model, trainer.tokenizer, trainer.optimizer, trainer.scheduler, run_config(trainer),
            trainer.is_lora, self.identity, sharded_by=self.dist if self.dist.fsdp else None,
            log_history=self.events.state.log_history),
            save_total_limit=config.save_total_limit, is_main=self.dist.is_main)
        seed_everything(config.seed)
        epoch, position = 0, 0
        if config.resume_from:
            epoch, position = self.resume()
        elif self.preflight is not None:
            # leaves the weights and the random state as they were
            self.preflight(self.rows, self.total_steps)
        self.logger = ForgeLogger(
            config.output_dir,
            use_wandb=config.use_wandb,
            wandb_project=config.wandb_project,
            wandb_run_name=config.wandb_run_name,
            use_tensorboard=config.use_tensorboard,
            use_trackio=config.use_trackio,
            trackio_project=config.trackio_project,
            config=run_config(trainer),
            enabled=self.dist.is_main,
        )
        if config.resume_from:
            self.logger.truncate_after(trainer.global_step)  # rows past the checkpoint come again, once
            self.health.resume(self.logger.log_path)  # the window the uninterrupted run would have had
        self.events.train_begin(config, self.total_steps, trainer.global_step, trainer.scheduler)
        if self.eval_rows is not None and config.eval_before_training and trainer.global_step == 0:
            self.evaluate(epoch)
        return epoch, position

    def resume(self) -> tuple[int, int]:
        """The checkpoint of config.resume_from back in place (weights, optimizer, schedule, RNG), with the
        step count, the guarded step's state, adaptive entropy and an auto micro-batch as they were. Returns
        the data position it had reached: (epoch, position)."""
        config, trainer = self.config, self.trainer
        resumed = self.lifecycle.resume(config.resume_from)
        trainer.global_step = resumed.step
        trainer.guard.restore(resumed.nonfinite_in_a_row, resumed.skipped_steps, resumed.loss_scale)
        if resumed.entropy_control:  # adaptive entropy control goes on from where it was
            trainer.entropy_control = dataclasses.replace(trainer.entropy_control,
                                                          **resumed.entropy_control)
        if resumed.micro_batch_size and config.micro_batch_size == "auto":  # as the preflight fitted it
            trainer.micro_batch_size = resumed.micro_batch_size
        self.events.state.num_input_tokens_seen = resumed.num_input_tokens_seen
        return resumed.epoch, resumed.position

    def run_steps(self, start_epoch: int, start_position: int) -> tuple[int, int]:
        """The steps, from (start_epoch, start_position) until total_steps, a stop or a failure (said with
        where the last finished step is saved). Returns the (epoch, position) of the last step."""
        config, trainer = self.config, self.trainer
        epoch, position = start_epoch, start_position
        self.lifecycle.finished(self.finished(epoch, position))
        bar = tqdm(total=self.total_steps, initial=trainer.global_step, desc="forge",
                   disable=not self.dist.is_main, dynamic_ncols=True)
        steps = iterate_steps(self.rows, trainer.rows_per_step, seed=config.seed, shuffle=config.shuffle,
                              epoch=epoch, position=position,
                              num_epochs=None if config.max_steps > 0 else config.num_train_epochs)
        if trainer.ahead is not None:  # async GRPO: each step's prompts reach the rollout worker early
            steps = trainer.ahead.schedule(steps, trainer)
        signals = trainer.signals
        signals.saves_on_abandon = not self.dist.fsdp  # a sharded save needs every rank (see where_to_resume)
        signals.under_way = trainer.global_step + config.updates_per_rollout  # what a signal's message names
        trainer.guard.committing = False  # no step's weights are being committed yet
        try:
            with signals:
                for batch_rows, epoch, position in steps:
                    if trainer.global_step >= self.total_steps:
                        break
                    self.events.step_begin(epoch)
                    self.check_config()  # what the callbacks changed since the last step
                    metrics = trainer.step(batch_rows)
                    signals.under_way = None  # finished: logged, evaluated, saved below
                    metrics["epoch"] = epoch + position / max(1, len(self.rows))
                    self.events.step_end(trainer.global_step, metrics["epoch"])  # callbacks may ask for more
                    self.after_step(metrics, epoch, position, bar)
                    self.stop_if_asked()
                    self.stop_on_alarm()
                    if self.events.control.should_training_stop:  # a callback ends the run as max_steps would
                        break
                    signals.under_way = trainer.global_step + config.updates_per_rollout
            self.check_config()  # before the final evaluation uses it
        except (StepFailed, FloatingPointError) as error:  # the weights are still those of the last step
            if trainer.global_step > 0:  # before step 1 nothing can resume: the error stays the last line
                error.args = (f"{error.args[0]}\n{self.where_to_resume()}",)
            self.dist.barrier()  # raised on every rank at once: none exits before rank 0 has saved
            self.logger.close()
            raise
        except KeyboardInterrupt:
            self.logger.close()
            if trainer.signals.requested is None:
                raise
            head = trainer.signals.describe(trainer.global_step, self.total_steps, abandoned=True)
            raise TrainingInterrupted(f"{head} {self.where_to_resume(every_rank_is_here=False)}") from None
        except BaseException:
            self.logger.close()
            raise
        finally:
            bar.close()
            steps.close()  # async GRPO: stops the rollout worker
        return epoch, position

    def after_step(self, metrics: dict, epoch: int, position: int, bar) -> None:
        """Log, evaluate and save after an optimizer step."""
        config, step, asked = self.config, self.trainer.global_step, self.events.control
        state = self.events.state  # TRL's num_tokens: prompt and completion tokens of the run so far
        state.num_input_tokens_seen += int(metrics.pop("_tokens", 0))
        metrics["num_tokens"] = state.num_input_tokens_seen
        self.losses += [row["loss"] for row in (metrics, *metrics.get("_later_updates", ()))]
        bar.update(step - bar.n)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
        if not self.warned_flat and self.dist.is_main:
            self.warned_flat = warn_if_mostly_flat(metrics)
        if self.rollouts_without_calls is not None and "tools/call_frequency" in metrics:
            called = metrics["tools/call_frequency"] > 0
            self.rollouts_without_calls = None if called else self.rollouts_without_calls + 1
            if not called and warn_if_tools_unused(self.rollouts_without_calls, announce=self.dist.is_main):
                self.rollouts_without_calls = None
        health, started = self.health.check(metrics)
        metrics.update(health)
        failures = [sample["episode_failure"] for sample in metrics.get("_samples", ())
                    if "episode_failure" in sample]
        for name in started if self.dist.is_main else ():
            example = f" (e.g. {failures[0]})" if name == "episodes_failing" and failures else ""
            tqdm.write(f"forge: health: step {step}: {name}: {HEALTH_RULES[name].says}{example}")
        self.log_rows(metrics, asked.should_log)
        # on_step_end's and on_log's changes, before they are used
        self.check_config(finished_at=(epoch, position))
        if self.eval_rows is not None and (reached(step, config.eval_steps, config.updates_per_rollout)
                                           or asked.should_evaluate):
            self.evaluate(epoch)
        # Nothing draws random numbers from here to the next step's sampling: this is the state it will use.
        finished = self.finished(epoch, position)
        if reached(step, config.save_steps, config.updates_per_rollout) or asked.should_save:
            self.lifecycle.save(finished)
            self.dist.barrier()  # the other ranks wait until rank 0's checkpoint is complete
            self.events.saved()
        self.lifecycle.finished(finished)
        self.alarms = [n for n in started if {n, "any"} & set(config.stop_on_health or ())]

    def check_config(self, finished_at: tuple[int, int] | None = None) -> None:
        """A callback's change of the config, checked as at start-up: ConfigRefused (a StepFailed: the last
        finished step is saved and named) for one the run refuses, on every rank when any refuses it.
        `finished_at`: the (epoch, position) of the step that just finished, when the lifecycle has not been
        told of it yet."""
        problem = self.config_watch.problem()
        if not self.dist.any(problem is not None):
            return
        if finished_at is not None:  # the step is whole (its update committed): it is what gets saved
            self.trainer.guard.committing = False
            self.lifecycle.finished(self.finished(*finished_at))
        raise ConfigRefused(
            f"after step {self.trainer.global_step} a callback changed the config to what the run "
            f"refuses: {problem or 'on another process (its output says what)'}"
        )

    def stop_if_asked(self) -> None:
        """After a finished step: a signal to any rank stops all of them here (rank 0 saves the step)."""
        signals = self.trainer.signals
        self.trainer.guard.committing = False
        if self.dist.any(signals.requested is not None):
            described = signals.describe(self.trainer.global_step, self.total_steps)
            message = f"{described} {self.where_to_resume()}"
            # no rank exits (and makes the launcher kill the rest) before the save is done
            self.dist.barrier()
            raise TrainingInterrupted(message)

    def stop_on_alarm(self) -> None:
        """After a finished step: a run-health alarm named in stop_on_health stops the run (every rank saw the
        same metrics, so every rank stops here; the step is saved)."""
        if self.alarms:
            raise HealthStop(
                f"step {self.trainer.global_step}: stopped on the run-health alarm {self.alarms[0]} "
                f"(stop_on_health): {HEALTH_RULES[self.alarms[0]].says}"
            )

    def where_to_resume(self, every_rank_is_here: bool = True) -> str:
        """Save the last finished step unless an optimizer step is under way; say where to resume from. A
        sharded save needs every rank, so under FSDP2 a stop that may have reached this rank alone (a second
        Ctrl-C) saves nothing new and names the newest checkpoint."""
        last = self.lifecycle.last_finished
        idle = (last is not None and last.step == self.trainer.global_step
                and not self.trainer.guard.committing)
        can_save = every_rank_is_here or not self.dist.fsdp
        return self.lifecycle.where_to_resume(weights_are_of_last_step=idle and can_save)

    def finished(self, epoch: int, position: int) -> FinishedStep:
        guard, control = self.trainer.guard, self.trainer.entropy_control
        return FinishedStep(
            self.trainer.global_step,
            epoch,
            position,
            capture_rng_state(),
            guard.nonfinite_in_a_row,
            guard.skipped_steps,
            guard.loss_scale,
            {"coef": control.coef, "last_entropy": control.last_entropy} if control.adaptive else None,
            self.trainer.micro_batch_size if self.config.micro_batch_size == "auto" else None,
            self.events.state.num_input_tokens_seen,
        )

    def train_summary(self, started: float) -> dict:
        """The last row of state.log_history, as transformers' Trainer logs it: this run's seconds, its
        completions and optimizer steps per second, and its mean loss per optimizer step."""
        runtime, config = time.perf_counter() - started, self.config
        steps = len(self.losses)
        per_step = config.completions_per_step * config.gradient_accumulation_steps // config.rollout_slices
        completions = steps * per_step  # those trained on: a slice's per optimizer step
        finite = [loss for loss in self.losses if math.isfinite(loss)]
        return {"train_runtime": runtime, "train_samples_per_second": completions / max(runtime, 1e-9),
                "train_steps_per_second": steps / max(runtime, 1e-9),
                "train_loss": sum(finite) / len(finite) if finite else float("nan")}

    def evaluate(self, epoch: int) -> None:
        metrics = self.trainer.evaluate(self.eval_rows)  # TRL's names: eval_reward, eval_runtime, ...
        self.log(metrics, self.trainer.global_step, epoch)
        self.events.evaluated(metrics)

    def log_rows(self, metrics: dict, asked: bool) -> None:
        """One row per optimizer step on the logging cadence (the last step and a callback's ask too), as in
        TRL: with num_iterations or rollout_slices > 1 the rollout's metrics and its first update's, then each
        later update's own."""
        later, epoch = metrics.pop("_later_updates", []), round(metrics["epoch"], 4)
        first = self.trainer.global_step - len(later)  # the optimizer step of the rollout's first update
        logged = False
        for step, row in enumerate([metrics, *later], start=first):
            if reached(step, self.config.logging_steps, 1) or step == self.total_steps or (
                    asked and step == self.trainer.global_step):
                self.log(row, step, epoch)
                logged = True
        if logged:
            self.logger.log_samples(metrics.pop("_samples"), step=first)

    def log(self, metrics: dict, step: int, epoch: float) -> None:
        """A row of training_log.jsonl (and the trackers); the callbacks' on_log and
        state.log_history get it too."""
        self.logger.log(metrics, step=step, epoch=epoch)
        self.events.log(metrics, step, epoch)


__all__ = ["ConfigRefused", "HealthStop", "StepFailed", "TrainingRun", "reached"]
