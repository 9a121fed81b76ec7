"""Async GRPO (max_staleness): a rollout worker process samples ahead of the trainer on the tiny model.

Each async run spawns one sampling process (~3 s to start on two cores), so these runs are few and short.
"""

import json
import math
import os
import signal

import pytest
import torch
from transformers import TrainerCallback

from forge import GRPOConfig, GRPOTrainer
from forge.core.batch import Batch
from forge.core.grpo import LossNormaliser
from forge.core.rollout_worker import RolloutWorkerError, needed_version
from forge.run import step_stats

ROWS = [{"prompt": f"{i} {i + 1} {i + 2}"} for i in range(8)]


def alternating(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def config_for(tmp_path, name, **overrides) -> GRPOConfig:
    values = {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "gradient_accumulation_steps": 1,
              "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
              "save_steps": 0, "max_steps": 5, "output_dir": str(tmp_path / name), "preflight": "off",
              "sampler_threads": 1}
    return GRPOConfig(**(values | overrides))


def train(tmp_path, name, model, tokenizer, callbacks=None, **overrides):
    trainer = GRPOTrainer(model, tokenizer, alternating, config_for(tmp_path, name, **overrides),
                          callbacks=callbacks)
    trainer.train(ROWS)
    log = [json.loads(line) for line in (tmp_path / name / "training_log.jsonl").read_text().splitlines()]
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, log


def fresh(tiny_tokenizer):
    from forge.model.tiny import build_tiny_model

    return build_tiny_model(tiny_tokenizer, seed=0)[0]


def test_the_schedule_samples_each_step_max_staleness_steps_back_never_before_the_first():
    assert [needed_version(s, 0, 1) for s in range(5)] == [0, 0, 1, 2, 3]  # one step off
    assert [needed_version(s, 0, 0) for s in range(3)] == [0, 1, 2]  # synchronous
    assert [needed_version(s, 4, 2) for s in range(4, 8)] == [4, 4, 4, 5]  # resumed at step 4


def test_max_staleness_0_gives_the_synchronous_runs_weights_bit_for_bit(tmp_path, tiny_tokenizer):
    synchronous, sync_log = train(tmp_path, "sync", fresh(tiny_tokenizer), tiny_tokenizer)
    on_worker, async_log = train(tmp_path, "async0", fresh(tiny_tokenizer), tiny_tokenizer, max_staleness=0)
    assert all(torch.equal(synchronous[n], on_worker[n]) for n in synchronous)
    assert any(row["param_delta_norm"] > 0 for row in sync_log)  # the weights moved: the test can fail
    assert [row["async/staleness_max"] for row in async_log] == [0.0] * 5
    assert [row["reward"] for row in async_log] == [row["reward"] for row in sync_log]


def test_one_step_off_keeps_staleness_at_most_1_repeats_under_a_seed_and_trains_lora(tmp_path, tiny_tokenizer):
    first, log = train(tmp_path, "a", fresh(tiny_tokenizer), tiny_tokenizer, max_staleness=1, use_lora=True)
    again, _ = train(tmp_path, "b", fresh(tiny_tokenizer), tiny_tokenizer, max_staleness=1, use_lora=True)
    synchronous, _ = train(tmp_path, "s", fresh(tiny_tokenizer), tiny_tokenizer, use_lora=True)
    assert [row["async/staleness_max"] for row in log] == [0.0, 1.0, 1.0, 1.0, 1.0]  # the fixed schedule
    assert all(torch.equal(first[n], again[n]) for n in first)  # the same samples and weights under a seed
    assert not all(torch.equal(first[n], synchronous[n]) for n in first)  # stale groups: another run
    assert all(math.isfinite(row["loss"]) for row in log)
    for key in ("async/trainer_wait_s", "async/sampler_idle_s", "async/queue_length", "async/staleness_mean"):
        assert all(key in row and row[key] >= 0 for row in log)


def test_staleness_2_never_exceeds_the_bound(tmp_path, tiny_tokenizer):
    _, log = train(tmp_path, "k2", fresh(tiny_tokenizer), tiny_tokenizer, max_staleness=2, max_steps=6)
    assert [row["async/staleness_max"] for row in log] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]


def test_a_stale_rollouts_ratio_is_taken_against_its_samplers_logprobs(tmp_path, tiny_model, tiny_tokenizer):
    """pi_old of a group sampled one step back is what its sampler recorded. With the recorded log-probs set
    to the trainer's minus log 1.25, every token's ratio is exp(log 1.25) = 1.25 and, with a positive
    advantage and clip_epsilon 0.2, each token's term is clipped to -1.2 * A: the loss is -1.2 A. The same
    rollout sampled by the weights as they are (policy_version None) has ratio 1 and loss -A."""
    config = config_for(tmp_path, "ratio", kl_beta=0.0, loss_type="grpo")
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, alternating, config)
    rollout = trainer.sample_completions(["1 2 3"], [{"prompt": "1 2 3"}])
    indices = torch.arange(rollout.completion_ids.shape[0])
    with torch.no_grad():
        current = trainer.rollout_logprobs(trainer.model, rollout, indices)  # (N, T), 0 on padding
    advantage = 0.5

    def loss_of(policy_version):
        rollout.policy_version, rollout.sampler_logprobs = policy_version, current - math.log(1.25)
        trainer.global_step = 1
        batch = Batch(rollouts=[rollout], rows=[[{"prompt": "1 2 3"}]],
                      advantages=[torch.full((len(indices),), advantage)], loss_mask=[rollout.completion_mask])
        batch.loss_indices = [indices]
        batch.old_logprobs = [trainer.old_logprobs(rollout, indices)]
        batch.ref_logprobs = [None]
        totals = step_stats.UpdateTotals()
        normaliser = LossNormaliser.count(batch.loss_mask, config.max_new_tokens)
        trainer.loss_and_backward(batch, 0, indices, normaliser, totals)
        return totals.as_metrics(), batch.old_logprobs[0]

    stale, old = loss_of(policy_version=0)
    assert old is rollout.sampler_logprobs
    assert stale["ratio_mean"] == pytest.approx(1.25, abs=1e-5)
    assert stale["clip_ratio/region_mean"] == pytest.approx(1.0)
    assert stale["loss"] == pytest.approx(-1.2 * advantage, abs=1e-5)
    fresh_metrics, old = loss_of(policy_version=None)
    assert old is None
    assert fresh_metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert fresh_metrics["loss"] == pytest.approx(-advantage, abs=1e-5)


class KillWorker(TrainerCallback):
    """SIGKILL the rollout worker after step 2, as a crash would."""

    def __init__(self):
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            os.kill(self.trainer.ahead.process.pid, signal.SIGKILL)


def test_a_worker_that_dies_stops_the_trainer_with_one_line_and_keeps_the_last_step(tmp_path, tiny_tokenizer):
    killer = KillWorker()
    config = config_for(tmp_path, "crash", max_staleness=1, max_steps=8, save_steps=1)
    trainer = GRPOTrainer(fresh(tiny_tokenizer), tiny_tokenizer, alternating, config, callbacks=[killer])
    killer.trainer = trainer
    with pytest.raises(RolloutWorkerError) as caught:
        trainer.train(ROWS)
    message = str(caught.value)
    assert "rollout worker (pid" in message and "killed by signal 9" in message
    assert "--resume" in message  # where the run goes on from
    assert trainer.global_step in (2, 3)  # the groups of step 3 may have been sampled before the kill
    assert (tmp_path / "crash" / f"checkpoint-{trainer.global_step}" / "COMPLETE").is_file()
    assert trainer.ahead.process is None  # stopped with the run: no process left behind


def test_a_failing_worker_sends_its_error(tmp_path, tiny_tokenizer):
    """A prompt over the budget fails in the worker; the trainer raises its one-line reason, not a hang."""
    rows = [{"prompt": " ".join(["7"] * 600)}] * 2
    config = config_for(tmp_path, "fails", max_staleness=1)
    trainer = GRPOTrainer(fresh(tiny_tokenizer), tiny_tokenizer, alternating, config)
    trainer.prompt_pool = None
    with pytest.raises((RolloutWorkerError, ValueError)) as caught:
        trainer.train(rows)
    assert "max_prompt_length" in str(caught.value)


@pytest.mark.parametrize("overrides, says", [
    ({"max_staleness": -1}, "max_staleness=-1 must be >= 0"),
    ({"max_staleness": 1, "fsdp": True}, "with fsdp=True leave max_staleness=None"),
    ({"max_staleness": 1, "num_iterations": 2}, "takes one update per rollout"),
    ({"max_staleness": 1, "dynamic_sampling": True}, "dynamic_sampling"),
    ({"max_staleness": 1, "rollout_timeout": 0}, "rollout_timeout=0 must be > 0"),
])
def test_bad_async_settings_are_refused_before_any_model_loads(overrides, says):
    with pytest.raises(ValueError, match="invalid GRPOConfig|max_staleness") as caught:
        GRPOConfig(**overrides).validate()
    assert says in str(caught.value)


def test_a_trl_async_script_runs_with_the_import_changed(model_folder, tmp_path):
    """TRL's async GRPO example, as `trl.experimental.async_grpo` documents it, with the import changed, the model
    a local folder and the lengths small."""
    from forge import AsyncGRPOConfig, AsyncGRPOTrainer  # was: from trl.experimental.async_grpo import ...

    def reward_len(completions, **kwargs):
        return [-abs(5 - len(completion)) for completion in completions]

    dataset = [{"prompt": prompt} for prompt in ("What is 2 + 3?", "Name a color.", "Count to three.", "Say yes.")]
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, max_completion_length=6,
                           per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=3,
                           logging_steps=1, report_to="none", max_staleness=1, weight_sync_steps=1,
                           max_inflight_tasks=-1, queue_maxsize=1024, heartbeat_stale_after_s=300.0)
    trainer = AsyncGRPOTrainer(model=model_folder, reward_funcs=reward_len, args=args, train_dataset=dataset)
    trainer.train()
    assert args.max_staleness == 1 and trainer.config.rollout_timeout == 300.0
    log = trainer.state.log_history
    assert [row["async/staleness_max"] for row in log if "async/staleness_max" in row] == [0.0, 1.0, 1.0]
    assert (tmp_path / "out" / "final").is_dir()


def test_async_trl_settings_forge_cannot_honour_are_refused(tmp_path):
    from forge import AsyncGRPOConfig, AsyncGRPOTrainer

    assert AsyncGRPOConfig().max_staleness == 1
    with pytest.raises(TypeError, match="weight_sync_steps=4"):
        AsyncGRPOConfig(weight_sync_steps=4)
    with pytest.raises(TypeError, match="rollout_worker"):
        AsyncGRPOTrainer(model="default", reward_funcs=alternating, rollout_worker=object())


def test_the_preflight_says_which_side_will_wait():
    from forge.core.preflight import PreflightReport, format_report

    def report(generation, step):
        return format_report(PreflightReport(
            prompts=2, group_size=4, max_new_tokens=8, truncated=0.0, finished_lengths={}, rewards=[], flat_low=0.0,
            flat_high=0.0, tokens_per_second=10.0, step_seconds=step, run_seconds=step * 10, seconds=1.0,
            prompt_as_seen="p", generation_step_seconds=generation, max_staleness=1))

    assert "sampling ~3.0 s and learning ~2.0 s a step" in report(3.0, 5.0)
    assert "the trainer waits for the worker" in report(3.0, 5.0)
    assert "the worker waits for the trainer" in report(1.0, 5.0)
    assert "async" not in format_report(PreflightReport(
        prompts=2, group_size=4, max_new_tokens=8, truncated=0.0, finished_lengths={}, rewards=[], flat_low=0.0,
        flat_high=0.0, tokens_per_second=10.0, step_seconds=5.0, run_seconds=50.0, seconds=1.0, prompt_as_seen="p"))
