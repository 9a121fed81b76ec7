"""Environments (forge/envs): one instance per completion driven through the rollout's one decode loop; TRL's
environment_factory classes as they are; isolation of raising, hanging and garbage environments; the token
budget and the model's context; results fed in one forward pass."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from test_tools import install_script, one_and_two_processes

import forge.core.rollout as rollout_module
from forge import GRPOConfig, GRPOTrainer
from forge.core.rollout import SamplingSettings, generate
from forge.core.tool_turns import TRUNCATION_MARKER
from forge.envs import EnvironmentSettings, Observation, episode_return
from forge.model.tiny import build_tiny_model
from forge.tools.calls import ToolSettings

TEMPERATURE = 0.7
ROWS = [{"prompt": "Add: ", "start": 10}, {"prompt": "Sum up: ", "start": 0}]


class Counter:
    """A running total: what the model reads depends on every earlier call of its own episode."""

    def reset(self, start: int = 0, **row):
        self.total = int(start)

    def add(self, amount: str) -> str:
        """Add to the running total and return it.

        Args:
            amount: the number to add
        """
        self.total += int(amount)
        return str(self.total)


class IncrementEnv:
    """TRL's own example environment (trl demo_grpo_environment.py), unchanged."""

    def __init__(self):
        self._counter = 0

    def reset(self) -> None:
        self._counter = 0

    def increment(self, a: int) -> int:
        """
        Increment the integer by a specified value

        Args:
            a: The value to increment by

        Returns:
            The incremented integer.
        """
        self._counter += int(a)
        return self._counter


def environment(factory, **limits) -> EnvironmentSettings:
    return EnvironmentSettings.of(factory, ToolSettings([], **limits))


@pytest.fixture
def scripted(monkeypatch):
    return install_script(monkeypatch.setattr)


def run(model, tokenizer, factory, rows=ROWS, group_size=2, max_new_tokens=30, noise=None, **limits):
    return generate(model, tokenizer, [r["prompt"] for r in rows], group_size,
                    SamplingSettings(max_new_tokens, TEMPERATURE), noise=noise,
                    tools=environment(factory, **limits), rows=rows)


def test_state_is_carried_across_turns_and_never_shared(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, "<add>3</add><add>4</add>")
    rollout = run(tiny_model, tiny_tokenizer, Counter)
    for n, start in enumerate([10, 10, 0, 0]):  # 4 instances; a shared one would have reached 3 + 4 + ... more
        assert rollout.completions[n].startswith(
            f"<add>3</add><result>{start + 3}</result><add>4</add><result>{start + 7}</result>")
        assert rollout.episodes[n].turns == 2 and rollout.environments[n].total == start + 7
    assert len({id(e) for e in rollout.environments}) == 4


def test_observation_tokens_are_fed_masked_and_the_loss_counts_the_models_tokens_only(scripted, tmp_path):
    model, tokenizer = build_tiny_model(seed=0)
    config = GRPOConfig(group_size=2, prompts_per_step=2, gradient_accumulation_steps=1, max_new_tokens=30,
                        temperature=TEMPERATURE, save_steps=0, max_steps=1, output_dir=str(tmp_path),
                        tool_format="text")
    seen = {}

    def reward(prompts, completions, environments, episodes, **kwargs):
        seen["totals"] = [env.total for env in environments]
        return [float(e.turns) + len(c) % 3 for e, c in zip(episodes, completions)]

    trainer = GRPOTrainer(model, tokenizer, reward_funcs=[reward], args=config, environment_factory=Counter)
    scripted(tokenizer, "<add>3</add>")
    batch, stats = trainer.collect(ROWS)
    (rollout,), (mask,) = batch.rollouts, batch.loss_mask
    call = len(tokenizer("<add>3</add>", add_special_tokens=False)["input_ids"])
    fed = 0
    for n, total in enumerate([13, 13, 3, 3]):
        result = tokenizer(f"<result>{total}</result>", add_special_tokens=False)["input_ids"]
        assert rollout.completion_ids[n, call:call + len(result)].tolist() == result
        assert rollout.action_mask[n, call:call + len(result)].tolist() == [0] * len(result)
        assert rollout.action_mask[n, :call].tolist() == [1] * call
        fed += len(result)
    assert torch.equal(mask, rollout.sampled_mask)  # fed tokens: no loss, in no count
    assert int(mask.sum()) == int(rollout.completion_mask.sum()) - fed
    assert seen["totals"] == [13, 13, 3, 3]
    assert stats.tool_calls[0].tolist() == [1.0, 1.0, 1.0, 1.0]  # the tools/* metrics count the turns


def test_a_trl_environment_class_runs_unchanged_and_its_rewards_get_the_environments(scripted, tmp_path):
    model, tokenizer = build_tiny_model(seed=0)

    def counter_reward(completions, environments, **kwargs):  # TRL's reward signature
        return [float(env._counter) for env in environments]

    config = GRPOConfig(group_size=2, prompts_per_step=2, gradient_accumulation_steps=1, max_new_tokens=64,
                        temperature=TEMPERATURE, save_steps=0, max_steps=1, output_dir=str(tmp_path),
                        tool_format="text", logging_steps=1)
    trainer = GRPOTrainer(model, tokenizer, reward_funcs=counter_reward, args=config, environment_factory=IncrementEnv)
    scripted(tokenizer, "<increment>2</increment><increment>5</increment>")
    batch, _ = trainer.collect(ROWS)
    rollout = batch.rollouts[0]
    assert all(t.startswith("<increment>2</increment><result>2</result><increment>5</increment><result>7</result>")
               for t in rollout.completions)
    scores = trainer.score(ROWS, rollout)
    assert scores.total.tolist() == [7.0] * 4
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    assert trainer.update(batch)["grad_norm"] == 0.0  # all rewards equal: no advantage, no gradient


def test_async_methods_are_awaited(scripted, tiny_model, tiny_tokenizer):
    class AsyncCounter(Counter):
        async def add(self, amount: str) -> str:
            """Add to the running total and return it.

            Args:
                amount: the number to add
            """
            await asyncio.sleep(0)
            self.total += int(amount)
            return str(self.total)

    scripted(tiny_tokenizer, "<add>3</add><add>4</add>")
    rollout = run(tiny_model, tiny_tokenizer, AsyncCounter)
    assert rollout.completions[0].startswith("<add>3</add><result>13</result><add>4</add><result>17</result>")


class Unruly(Counter):
    def boom(self, x: str) -> str:
        """Raise.

        Args:
            x: anything
        """
        raise RuntimeError("the environment broke")

    def hang(self, x: str) -> str:
        """Never answer in time.

        Args:
            x: anything
        """
        time.sleep(3)
        return "late"

    def huge(self, x: str) -> str:
        """Answer with a megabyte.

        Args:
            x: anything
        """
        return "z" * 1_000_000

    def garbage(self, x: str) -> object:
        """Return what cannot be read as text.

        Args:
            x: anything
        """
        class Unprintable:
            def __str__(self):
                raise ValueError("no text for you")
        return Unprintable()


def test_raising_hanging_huge_and_garbage_methods_cost_only_their_call(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, "<boom>1</boom><hang>1</hang><huge>1</huge><garbage>1</garbage><add>1</add>")
    started = time.perf_counter()
    rollout = run(tiny_model, tiny_tokenizer, Unruly, rows=ROWS[:1], group_size=1, max_new_tokens=80,
                  timeout=0.5, max_output_chars=50, max_calls=5)
    assert time.perf_counter() - started < 3
    calls = rollout.tool_calls[0]
    assert [c.failure for c in calls] == ["error", "timeout", None, "error", None]
    assert calls[0].output == "error: RuntimeError: the environment broke"
    assert calls[2].truncated and len(calls[2].output) < 120
    assert "no text for you" in calls[3].output
    assert calls[4].output == "11"  # the episode goes on: its state is intact


def test_a_failing_factory_or_reset_fails_only_its_episode(tiny_model, tiny_tokenizer, tmp_path):
    built = []

    class Flaky(Counter):
        def reset(self, start: int = 0, **row):
            built.append(1)
            if len(built) % 2 == 0:
                raise RuntimeError("reset broke")
            super().reset(start)

    rollout = run(tiny_model, tiny_tokenizer, Flaky, max_new_tokens=6)
    failed = rollout.failed.tolist()
    assert failed.count(True) == 2 and failed.count(False) == 2
    for n, bad in enumerate(failed):
        assert (int(rollout.completion_lengths[n]) == 0) == bad
        assert (rollout.episodes[n].failure or "").startswith("Flaky.reset: error: RuntimeError: reset broke") == bad

    model, tokenizer = build_tiny_model(seed=0)
    built.clear()
    config = GRPOConfig(group_size=2, prompts_per_step=2, gradient_accumulation_steps=1, max_new_tokens=6,
                        save_steps=0, max_steps=1, output_dir=str(tmp_path), tool_format="text")
    trainer = GRPOTrainer(model, tokenizer, lambda p, c, **k: [float(len(t)) for t in c], config,
                          environment_factory=Flaky)
    built.clear()
    batch, stats = trainer.collect(ROWS)
    assert batch.loss_mask[0][batch.rollouts[0].failed].sum() == 0  # no loss on a failed episode
    assert torch.cat(stats.valid).tolist() == [not f for f in batch.rollouts[0].failed.tolist()]


def test_the_turn_limit_ends_the_episode(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, "<add>1</add><add>2</add><add>3</add> more")
    rollout = run(tiny_model, tiny_tokenizer, Counter, rows=ROWS[:1], group_size=1, max_new_tokens=60, max_calls=2)
    assert rollout.completions[0] == "<add>1</add><result>11</result><add>2</add><result>13</result><add>3</add>"
    assert not rollout.truncated[0] and rollout.episodes[0].turns == 2


def test_per_turn_rewards_and_the_end_of_an_episode(scripted, tiny_model, tiny_tokenizer):
    class Game(Counter):
        def add(self, amount: str) -> Observation:
            """Add; the episode ends at 15 or more.

            Args:
                amount: the number to add
            """
            self.total += int(amount)
            return Observation(f"total {self.total}", reward=0.5, done=self.total >= 15)

    scripted(tiny_tokenizer, "<add>3</add><add>4</add><add>5</add>")
    rollout = run(tiny_model, tiny_tokenizer, Game, max_new_tokens=60)
    first, last = rollout.episodes[0], rollout.episodes[2]
    assert rollout.completions[0] == "<add>3</add><result>total 13</result><add>4</add><result>total 17</result>"
    assert first.done and first.rewards == [0.5, 0.5] and not rollout.truncated[0]
    assert last.rewards == [0.5, 0.5, 0.5] and not last.done  # 0 + 3 + 4 + 5 = 12: it goes on
    assert episode_return(None, None, episodes=rollout.episodes) == [1.0, 1.0, 1.5, 1.5]


def test_the_opening_observation_is_appended_to_the_prompt(tiny_model, tiny_tokenizer):
    class Opening(Counter):
        def reset(self, start: int = 0, **row):
            super().reset(start)
            return f"You start at {start}."

    rollout = run(tiny_model, tiny_tokenizer, Opening, max_new_tokens=4)
    prompts = tiny_tokenizer.batch_decode(rollout.prompt_ids, skip_special_tokens=True)
    assert prompts[0].endswith("Add: You start at 10.") and prompts[1].endswith("Sum up: You start at 0.")

    drawn = iter(range(100))

    class Random(Counter):
        def reset(self, **row):
            return f"seed {next(drawn)}"  # not a function of the row: the group's second episode opens otherwise

    rollout = run(tiny_model, tiny_tokenizer, Random, max_new_tokens=4)
    assert rollout.failed.tolist() == [False, True, False, True]
    assert "share their prompt" in rollout.episodes[1].failure


def test_an_environment_that_never_answers_samples_what_a_plain_run_samples(tiny_model, tiny_tokenizer):
    noise = torch.rand(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    settings = SamplingSettings(16, TEMPERATURE)
    plain = generate(tiny_model, tiny_tokenizer, [r["prompt"] for r in ROWS], 2, settings, noise=noise)
    with_env = run(tiny_model, tiny_tokenizer, Counter, max_new_tokens=16, noise=noise)
    assert all(e.turns == 0 for e in with_env.episodes)
    mask = plain.completion_mask.bool()
    width = with_env.completion_ids.shape[1]
    assert torch.equal(with_env.completion_mask, plain.completion_mask[:, :width])
    assert torch.equal(with_env.completion_ids[mask[:, :width]], plain.completion_ids[mask])
    # the plain decode attends over each group's prompt stored once, the environment's over the prompt repeated
    # per row (forge/model/kv_cache.py): the same values up to the order of fp32 sums
    torch.testing.assert_close(with_env.sampler_logprobs[:, :width], plain.sampler_logprobs[:, :width],
                               atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------
# The token budget, the context, and one forward per result


class Verbose(Counter):
    def read(self, x: str) -> str:
        """A long page.

        Args:
            x: anything
        """
        return "page " * 200


def test_a_result_over_the_token_budget_is_cut_marked_and_ends_the_completion(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, "<read>1</read>")
    rollout = run(tiny_model, tiny_tokenizer, Verbose, rows=ROWS[:1], group_size=1, max_new_tokens=20,
                  max_output_chars=5000, max_episode_tokens=150)
    assert int(rollout.completion_lengths[0]) == 150
    assert rollout.completions[0].startswith("<read>1</read><result>page page")
    assert rollout.completions[0].endswith(TRUNCATION_MARKER) and rollout.truncated[0]


def test_fed_results_never_run_past_the_models_context(scripted, tiny_tokenizer):
    model, _ = build_tiny_model(tiny_tokenizer, seed=0)
    model.config.max_position_embeddings = 64
    positions = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(int(kwargs["position_ids"].max())), with_kwargs=True)
    assert TRUNCATION_MARKER.strip() == "[truncated: token budget]"
    scripted(tiny_tokenizer, "<read>1</read>")
    rollout = run(model, tiny_tokenizer, Verbose, max_new_tokens=30, max_output_chars=5000)
    prompt_lengths = rollout.prompt_mask.sum(dim=1).repeat_interleave(2)
    assert int((prompt_lengths + rollout.completion_lengths).max()) == 64
    assert max(positions) <= 63 and all(t.endswith(TRUNCATION_MARKER) for t in rollout.completions)


def test_a_result_is_fed_in_one_forward_and_the_models_logprobs_stay_exact(scripted, tiny_model, tiny_tokenizer):
    tiny_model.config.max_position_embeddings = 4096  # room for the whole page
    widths = []
    tiny_model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    scripted(tiny_tokenizer, "<read>1</read>")
    rollout = run(tiny_model, tiny_tokenizer, Verbose, max_new_tokens=24, max_output_chars=5000)
    fed = int((rollout.completion_mask * (1 - rollout.action_mask)).sum(dim=1).max())
    assert fed > 500  # hundreds of result tokens ...
    decode = widths[1:]
    assert sum(1 for _, width in decode if width > 1) == 1  # ... in one forward pass
    assert len(decode) <= 24  # one forward per sampled token, not per fed token
    # The sampler's log-probs of the model's own tokens are those of one plain forward of prompt + completion.
    for n in range(4):
        length = int(rollout.completion_lengths[n])
        prompt = rollout.prompt_ids[n // 2][rollout.prompt_mask[n // 2].bool()]
        ids = torch.cat([prompt, rollout.completion_ids[n, :length]])[None]
        with torch.no_grad():
            logits = tiny_model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
        sampled = rollout.action_mask[n, :length].bool()
        torch.testing.assert_close(rollout.sampler_logprobs[n, :length][sampled], logprobs[sampled],
                                   rtol=0, atol=1e-5)


def test_rollout_module_has_one_decode_loop():
    assert [name for name in vars(rollout_module) if name.startswith("generate")] == ["generate"]


def test_a_textarena_game_runs_unchanged_through_the_protocol(scripted, tiny_model, tiny_tokenizer):
    """TextArena's GuessTheNumber-v0 (optional: `pip install textarena`), adapted by forge/envs/text_arena.py."""
    pytest.importorskip("textarena")
    from forge.envs.text_arena import text_arena_factory

    game = text_arena_factory("GuessTheNumber-v0")
    scripted(tiny_tokenizer, "<act>[10]</act><act>[5]</act>")
    rows = [{"prompt": "Play: ", "seed": 3}]
    rollout = run(tiny_model, tiny_tokenizer, game, rows=rows, group_size=2, max_new_tokens=40)
    prompt = tiny_tokenizer.decode(rollout.prompt_ids[0], skip_special_tokens=True)
    assert "You are playing Guess The Number" in prompt  # the game's opening, appended to the prompt
    for n in range(2):  # the number of seed 3 is 8
        assert rollout.completions[n].startswith("<act>[10]</act><result>[GAME] The target number is lower."
                                                 "</result><act>[5]</act><result>[GAME] The target number is "
                                                 "higher.</result>")
        assert rollout.episodes[n].turns == 2 and rollout.environments[n] is not rollout.environments[1 - n]


# ----------------------------------------------------------------------------------------------------
# Resume and processes: environments are rebuilt from the rows, never saved

GUESS_ROWS = [{"prompt": f"Find it ({k}): ", "secret": 1 + k % 7, "high": 7, "episode": k} for k in range(4)]
GUESS = "<guess>3</guess>"


def guess_run(tmp_path, name, **overrides):
    from safetensors.torch import load_file

    from forge.envs.guess import NoisyGuessNumber

    values = {"preflight": "off", "group_size": 4, "max_new_tokens": 16, "gradient_accumulation_steps": 1,
              "prompts_per_step": 2, "learning_rate": 1e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0,
              "logging_steps": 1, "save_steps": 1, "max_steps": 4, "kl_beta": 0.0, "seed": 5, "tool_format": "text",
              "temperature": TEMPERATURE, "log_completions": 8, "output_dir": str(tmp_path / name)}
    model, tokenizer = build_tiny_model(seed=0)

    def length(prompts, completions, **kwargs):
        return [len(text) % 5 / 4 for text in completions]

    GRPOTrainer(model, tokenizer, length, GRPOConfig(**(values | overrides)),
                environment_factory=NoisyGuessNumber).train(GUESS_ROWS)
    samples = (tmp_path / name / "samples.jsonl").read_text().splitlines()
    return samples, load_file(tmp_path / name / "final" / "model.safetensors")


def test_a_run_with_an_environment_resumes_bitwise(scripted, tmp_path):
    scripted(build_tiny_model(seed=0)[1], GUESS)
    straight_samples, straight = guess_run(tmp_path, "straight")
    assert len(straight_samples) == 8 and all("<guess>3</guess><result>" in s for s in straight_samples)
    guess_run(tmp_path, "resumed", max_steps=2)
    resumed_samples, resumed = guess_run(tmp_path, "resumed", resume_from="latest")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert resumed_samples == straight_samples


ENV_DRIVER_FILE = '''
import sys
sys.path.insert(0, {tests_dir!r})
from test_tools import install_script
from forge.cli import main
from forge.model.tiny import build_tiny_tokenizer

install_script(setattr)(build_tiny_tokenizer(), {call!r})
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_two_processes_with_an_environment_give_the_transcripts_and_weights_of_one(scripted, tmp_path):
    """`torch.distributed.run --nproc_per_node 2` of `forge train --environment ...` vs one process: each rank
    builds the environments of its own rows; the transcripts (answers included) and the weights are those of one."""
    import json
    from pathlib import Path


    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in GUESS_ROWS))
    (tmp_path / "rewards.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [len(t) % 5 / 4 for t in completions]\n")
    tests_dir = Path(__file__).parent
    (tmp_path / "driver.py").write_text(ENV_DRIVER_FILE.format(tests_dir=str(tests_dir), call=GUESS))
    args = ["train", "--model", str(tmp_path / "tiny"), "--dataset", str(tmp_path / "data.jsonl"),
            "--reward", f"{tmp_path / 'rewards.py'}:length", "--environment", "forge.envs.guess:NoisyGuessNumber",
            "--group_size", "4", "--prompts_per_step", "2", "--gradient_accumulation_steps", "1",
            "--max_new_tokens", "16", "--max_steps", "2", "--logging_steps", "1", "--log_completions", "8",
            "--learning_rate", "0.01", "--temperature", str(TEMPERATURE), "--tool_format", "text", "--seed", "3",
            "--save_steps", "0", "--preflight", "off"]
    scripted(tokenizer, GUESS)
    one, two, expected, got = one_and_two_processes(tmp_path, args)
    assert one == two and len(one) == 4
    assert all("<result>" in json.dumps(sample) for sample in one)  # every transcript holds an answer
    # The same transcripts and rewards, gradients equal up to fp32 summation order (two halves all-reduced vs one
    # sum). AdamW divides by sqrt(v): on an element whose gradient is ~0 that rounding can tip its update, by at
    # most lr per step. So: nearly every element to fp32 tolerance, and none off by more than 2 steps of lr.
    close = torch.cat([torch.isclose(got[k], v, rtol=1e-4, atol=1e-6).flatten() for k, v in expected.items()])
    assert close.float().mean() > 0.999
    assert max(float((got[k] - v).abs().max()) for k, v in expected.items()) <= 2 * 0.01 + 1e-6


def test_forge_train_with_an_environment_that_scores_itself_needs_no_reward_flag(tmp_path, capsys):
    import json

    from forge.cli import main

    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in GUESS_ROWS))
    assert main(["train", "--model", str(tmp_path / "tiny"), "--dataset", str(tmp_path / "data.jsonl"),
                 "--environment", "forge.envs.guess:GuessNumber", "--tool_format", "text", "--group_size", "2",
                 "--prompts_per_step", "2", "--max_new_tokens", "8", "--max_steps", "1", "--logging_steps", "1",
                 "--save_steps", "0", "--preflight", "off", "--output_dir", str(tmp_path / "out")]) == 0
    assert "its get_reward is the reward" in capsys.readouterr().err
    log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert {key.split("/")[1] for key in log[0] if key.startswith("rewards/") and key.count("/") == 2} == {
        "GuessNumber"}  # rewards/NAME/mean and /std: the environment's reward only


# ----------------------------------------------------------------------------------------------------
# failing loudly and by count


class BrokenInit(Counter):
    def __init__(self):
        raise RuntimeError("no database")


class HangingInit(Counter):
    def __init__(self):
        time.sleep(3)


def test_a_factory_that_raises_or_hangs_is_one_line_naming_the_class_and_method():
    with pytest.raises(ValueError, match=r"^environment_factory BrokenInit: BrokenInit\.__init__ raised "
                                         r"RuntimeError: no database; ") as caught:
        environment(BrokenInit, timeout=0.5)
    assert "\n" not in str(caught.value)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"HangingInit\.__init__ did not return within tool_timeout=0\.5 s"):
        environment(HangingInit, timeout=0.5)
    assert time.perf_counter() - started < 2


class FailsByRow(Counter):
    """reset raises for the row starting at 10 and hangs for the row starting at 0."""

    def reset(self, start: int = 0, **row):
        if int(start) == 10:
            raise RuntimeError("reset broke")
        time.sleep(2)


def test_failed_and_timed_out_episodes_are_counted_alarmed_and_marked(tmp_path, capsys):
    import json

    seen = []

    def reward(prompts, completions, environments, episodes, **kwargs):
        seen.extend(zip(environments, episodes))
        return [1.0] * len(completions)

    model, tokenizer = build_tiny_model(seed=0)
    config = GRPOConfig(group_size=2, prompts_per_step=2, gradient_accumulation_steps=1, max_new_tokens=6,
                        save_steps=0, max_steps=1, logging_steps=1, output_dir=str(tmp_path), tool_format="text",
                        tool_timeout=0.5)
    trainer = GRPOTrainer(model, tokenizer, reward, config, environment_factory=FailsByRow)
    trainer.train(ROWS)
    log = json.loads((tmp_path / "training_log.jsonl").read_text().splitlines()[0])
    assert (log["env/failed_episodes"], log["env/timed_out_episodes"], log["env/frac_failed_episodes"]) == (4, 2, 1.0)
    assert log["health/episodes_failing"] == 1.0
    assert "episodes_failing: most of this step's environment episodes failed" in capsys.readouterr().out
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["episode_failure"][:41] for s in samples) == ["FailsByRow.reset: error: RuntimeError: re",
                                                                  "FailsByRow.reset: error: the call took lo"]
    assert all(env is None and episode.failure for env, episode in seen)  # a failed episode has no instance


class Surrogates(Counter):
    def reset(self, start: int = 0, **row):
        super().reset(start)
        return " open\udcff"

    def add(self, amount: str) -> str:
        """Add to the running total.

        Args:
            amount: the number to add
        """
        return "bad \ud800 bytes"


def test_lone_surrogates_from_environments_are_replaced_before_tokenizing(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, "<add>3</add>")
    rollout = run(tiny_model, tiny_tokenizer, Surrogates, rows=ROWS[:1], group_size=1, max_new_tokens=20)
    assert rollout.episodes[0].failure is None
    assert rollout.completions[0].startswith("<add>3</add><result>bad \ufffd bytes</result>")
    assert rollout.episodes[0].opening == " open\ufffd"


class TextReward(Counter):
    def add(self, amount: str) -> Observation:
        """Add to the running total.

        Args:
            amount: the number to add
        """
        return Observation("ok", reward="high")


def test_a_reward_that_is_not_a_number_fails_the_episode_naming_environment_and_method(scripted, tiny_model,
                                                                                       tiny_tokenizer):
    scripted(tiny_tokenizer, "<add>3</add><add>4</add>")
    rollout = run(tiny_model, tiny_tokenizer, TextReward, rows=ROWS[:1], group_size=1, max_new_tokens=30)
    episode = rollout.episodes[0]
    assert episode.failure == ("TextReward.add returned Observation(reward='high'); a reward is a number or None")
    assert bool(rollout.failed[0]) and episode.turns == 1 and episode.rewards == []


class Shadowing(Counter):
    def reset(self, start: int = 0, **row):
        super().reset(start)
        self.add = 0  # an attribute named like a tool method


def test_an_attribute_named_like_a_method_does_not_hide_the_method(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, "<add>3</add>")
    rollout = run(tiny_model, tiny_tokenizer, Shadowing, rows=ROWS[:1], group_size=1, max_new_tokens=20)
    assert rollout.episodes[0].failure is None and rollout.tool_calls[0][0].failure is None
