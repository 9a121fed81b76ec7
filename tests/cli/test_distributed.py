"""Data-parallel training: 2 CPU processes (gloo) train exactly like 1 process with the same global batch.

The runs use the tiny model saved to a folder, LoRA with the KL term, the DAPO token-mean loss (normalised by
the token count of all ranks), batch-std advantages (they need every rank's rewards), two rollout batches per
optimizer step and micro-batches that split groups. What makes 1 and 2 processes comparable at all: the
sampling noise of a rollout batch is drawn from a generator seeded by (seed, step), every rank draws all of it
and keeps the rows of its own prompts, so each prompt gets the same completions on 1 or 2 processes (the
ranks still sample differently: their rows of the noise differ). Left to fp32 rounding: prompts are batched
and padded with different neighbours, and the loss and gradient are sums in another order.

    single    `forge train` in this process (same code, one rank)
    two       `python -m torch.distributed.run --nproc_per_node=2` on a small driver: `forge train` with a
              recorder that writes, per rank and step, the trainable weights, the prompts it generated for
              and every checkpoint save
    resumed   `forge train --nproc 2 --resume` (the CLI's own relaunch) from the two-process run's step-2
              checkpoint

Checked: after every step both ranks hold bitwise-identical weights, equal (fp32 tolerance) to the single run's
weights; the ranks' prompts are disjoint and together the single run's; the logged metrics and the sampled
completions match the single run's; one training_log.jsonl with each step once, samples once; each checkpoint
written once, by rank 0; the resumed run ends with the uninterrupted run's weights and logs step 3 once.

In one process: the noise sampler by hand, generation that does not depend on the batch, the refusal of
DeepSpeed/Megatron-LM launches, and the cross-rank agreements (a reward failing or a signal arriving on another
rank stops every rank at the same point) with the other rank's answer faked.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from forge import GRPOConfig, GRPOTrainer
from forge.cli import main as forge_main
from forge.core.rollout import SamplingSettings, generate, sample_next_token
from forge.core.scoring import RewardError
from forge.core.trainer import TrainingInterrupted
from forge.model.tiny import build_tiny_model

STEPS = 3
NPROC = 2
WALL_CLOCK_FIELDS = {"time", "step_time", "tokens_per_second", "generation_share"}

REWARD_FILE = '''
def text_length(prompts, completions, **kwargs):
    """Varies inside a group, so every group carries a learning signal."""
    return [len(text) % 7 / 6 for text in completions]
'''

# torch.distributed.run starts this file in each process: forge train, recorded.
DRIVER_FILE = '''
import os, sys
sys.path.insert(0, {tests_dir!r})
from test_distributed import install_recorder
from forge.cli import main

install_recorder(os.environ["FORGE_TEST_RECORD"], int(os.environ["RANK"]), setattr)
sys.exit(main(sys.argv[1:]))
'''


def install_recorder(record_dir: str, rank: int, patch) -> None:
    """Wrap the trainer so each rank appends to {record_dir}/rank{rank}.jsonl: the prompts it generated for,
    the hash and values of its trainable weights after each step, and every checkpoint it saved."""
    from forge.core.trainer import GRPOTrainer
    from forge.run import checkpoint

    log_path = Path(record_dir) / f"rank{rank}.jsonl"

    def write(record: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps({"rank": rank, **record}) + "\n")

    real_generate, real_step, real_save = GRPOTrainer.sample_completions, GRPOTrainer.step, checkpoint.save_checkpoint

    def recorded_generate(self, prompts, rows=None):
        write({"kind": "prompts", "step": self.global_step + 1, "prompts": list(prompts)})
        return real_generate(self, prompts, rows)

    def recorded_step(self, rows):
        metrics = real_step(self, rows)
        weights = torch.cat([p.detach().flatten() for p in self.trainable])  # (num_trainable,)
        write({"kind": "weights", "step": self.global_step,
               "sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()})
        torch.save(weights, Path(record_dir) / f"rank{rank}-step{self.global_step}.pt")
        return metrics

    def recorded_save(path, **kwargs):
        write({"kind": "save", "path": Path(path).name})
        return real_save(path, **kwargs)

    patch(GRPOTrainer, "sample_completions", recorded_generate)
    patch(GRPOTrainer, "step", recorded_step)
    patch(checkpoint, "save_checkpoint", recorded_save)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_workspace(root: Path, reward_file: str, driver_file: str) -> Path:
    """The tiny model saved to {root}/tiny, 8 rows of different lengths, the reward file and the driver."""
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    rows = [{"prompt": f"What is {a} + {b}?" + " Answer:" * (a % 3), "reference": str(a + b)}
            for a in range(4) for b in range(2)]
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "rewards.py").write_text(reward_file)
    (root / "driver.py").write_text(driver_file.format(tests_dir=str(Path(__file__).parent)))
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_workspace(tmp_path_factory.mktemp("distributed"), REWARD_FILE, DRIVER_FILE)


def train_args(root: Path, output_dir: Path) -> list[str]:
    """One optimizer step = 2 rollout batches of 4 prompts x 4 completions; with 2 ranks, 2 prompts each."""
    return ["train", "--model", str(root / "tiny"), "--dataset", str(root / "data.jsonl"),
            "--reward", f"{root / 'rewards.py'}:text_length", "--output_dir", str(output_dir),
            "--group_size", "4", "--prompts_per_step", "4", "--gradient_accumulation_steps", "2",
            "--micro_batch_size", "3", "--max_new_tokens", "8", "--max_steps", str(STEPS), "--save_steps", "2",
            "--logging_steps", "1", "--log_completions", "8", "--use_lora", "true", "--lora_r", "4",
            "--kl_beta", "0.05", "--loss_type", "dapo", "--scale_rewards", "batch", "--learning_rate", "0.05",
            "--seed", "5", "--preflight", "off"]  # the recorded generations are the steps'


def launcher_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


@pytest.fixture(scope="module")
def single(workspace):
    """The reference: one process, the same global batch and seed."""
    record = workspace / "record-single"
    record.mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_recorder(str(record), 0, monkeypatch.setattr)
        assert forge_main(train_args(workspace, workspace / "single")) == 0
    return workspace / "single", record


@pytest.fixture(scope="module")
def two(workspace):
    record = workspace / "record-two"
    record.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
               str(workspace / "driver.py"), *train_args(workspace, workspace / "two")]
    done = subprocess.run(command, check=False, env={**launcher_env(), "FORGE_TEST_RECORD": str(record)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return workspace / "two", record, done.stdout


def records(record_dir: Path, kind: str) -> list[dict]:
    return [r for path in sorted(record_dir.glob("rank*.jsonl")) for r in read_jsonl(path) if r["kind"] == kind]


def test_every_rank_holds_the_same_weights_after_every_step(two):
    _, record, _ = two
    by_step: dict[int, dict[int, str]] = {}
    for r in records(record, "weights"):
        by_step.setdefault(r["step"], {})[r["rank"]] = r["sha256"]
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for step, hashes in by_step.items():
        assert sorted(hashes) == list(range(NPROC)), f"step {step}: records from ranks {sorted(hashes)}"
        assert len(set(hashes.values())) == 1, f"step {step}: the ranks' weights differ"
    initial = torch.load(record / "rank0-step1.pt")
    assert not torch.equal(initial, torch.load(record / f"rank0-step{STEPS}.pt")), "training did not move weights"


def test_each_rank_gets_a_distinct_share_of_the_single_runs_prompts(single, two):
    _, single_record = single
    _, two_record, _ = two
    for step in range(1, STEPS + 1):
        batches = [r["prompts"] for r in records(single_record, "prompts") if r["step"] == step]
        per_rank = {rank: [r["prompts"] for r in records(two_record, "prompts") if r["step"] == step
                           and r["rank"] == rank] for rank in range(NPROC)}
        assert len(batches) == 2 and all(len(b) == 4 for b in batches)  # gradient_accumulation_steps x 4
        for b, batch in enumerate(batches):  # rank r takes prompts 2r, 2r+1 of every rollout batch
            assert [p for rank in range(NPROC) for p in per_rank[rank][b]] == batch
        assert not set(map(str, per_rank[0])) & set(map(str, per_rank[1]))


def test_two_processes_train_like_one_with_the_same_global_batch(single, two):
    single_dir, single_record = single
    two_dir, two_record, _ = two
    for step in range(1, STEPS + 1):
        one = torch.load(single_record / f"rank0-step{step}.pt")
        both = torch.load(two_record / f"rank0-step{step}.pt")
        assert torch.allclose(both, one, rtol=1e-4, atol=1e-6), \
            f"step {step}: max weight difference {float((both - one).abs().max())}"
    # Same completions and rewards, so the equivalence is not an accident of a zero gradient.
    assert read_jsonl(two_dir / "samples.jsonl") == read_jsonl(single_dir / "samples.jsonl")
    single_log, two_log = read_jsonl(single_dir / "training_log.jsonl"), read_jsonl(two_dir / "training_log.jsonl")
    assert [row["step"] for row in two_log] == [row["step"] for row in single_log]
    for one_row, two_row in zip(single_log, two_log):
        assert one_row.keys() == two_row.keys()
        for key in one_row.keys() - WALL_CLOCK_FIELDS:
            assert two_row[key] == pytest.approx(one_row[key], rel=1e-4, abs=1e-6), f"step {one_row['step']}: {key}"
    assert two_log[-1]["grad_norm"] > 0 and two_log[-1]["param_delta_norm"] > 0


def test_rank_0_alone_logs_and_saves_each_checkpoint_once(two):
    two_dir, record, stdout = two
    assert sorted(p.name for p in two_dir.iterdir()) == ["checkpoint-2", "final", "samples.jsonl",
                                                         "training_log.jsonl"]
    assert [row["step"] for row in read_jsonl(two_dir / "training_log.jsonl")] == list(range(1, STEPS + 1))
    samples = read_jsonl(two_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [step for step in range(1, STEPS + 1) for _ in range(8)]
    assert [(r["rank"], r["path"]) for r in records(record, "save")] == [(0, "checkpoint-2"), (0, "final")]
    assert stdout.count("done: 3 optimizer steps") == 1  # printed by rank 0 only


def test_forge_train_nproc_resumes_a_two_process_checkpoint(workspace, two):
    """`forge train --nproc 2 --resume`: both ranks load step 2 and finish like the run that was not stopped.

    Only rank 0 writes, so rank 1's weights show in the result: had it not loaded the checkpoint, its gradient
    (summed into rank 0's) would differ and so would the final weights."""
    two_dir, _, _ = two
    resumed = workspace / "resumed"
    shutil.copytree(two_dir, resumed)
    shutil.rmtree(resumed / "final")
    done = subprocess.run([sys.executable, "-m", "forge", *train_args(workspace, resumed), "--nproc", str(NPROC),
                           "--resume"], check=False, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    expected = load_file(two_dir / "final" / "adapter_model.safetensors")
    got = load_file(resumed / "final" / "adapter_model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    log = read_jsonl(resumed / "training_log.jsonl")
    assert [row["step"] for row in log] == list(range(1, STEPS + 1))
    assert log[-1]["loss"] == read_jsonl(two_dir / "training_log.jsonl")[-1]["loss"]
    said = done.stderr.splitlines()  # rank 0 alone says Forge's notes and warnings
    assert sum(line.startswith("[forge] generation_backend auto:") for line in said) == 1, done.stderr[-3000:]
    assert sum(line.startswith("forge: warning: 8 prompts are plain strings") for line in said) == 1


# ----------------------------------------------------------------------------------------------------
# the parts, in one process


def test_noise_sampling_picks_the_token_whose_cdf_interval_holds_the_draw():
    # probabilities [0.2, 0.5, 0.3]: cdf 0.2, 0.7, 1.0
    logits = torch.tensor([[0.2, 0.5, 0.3]] * 4).log()
    settings = SamplingSettings(temperature=1.0)
    draws = torch.tensor([0.0, 0.19, 0.5, 0.71])
    assert sample_next_token(logits, settings, draws).tolist() == [0, 0, 1, 2]
    # top_k=2 removes token 0; a draw rounded up to the very end still lands on an allowed token
    top_k = SamplingSettings(temperature=1.0, top_k=2)
    logits = torch.tensor([[0.3, 0.5, 0.2], [0.3, 0.5, 0.2]]).log()  # keeps tokens 0 and 1
    assert sample_next_token(logits, top_k, torch.tensor([0.0, 1.0])).tolist() == [0, 1]


def test_noise_driven_generation_does_not_depend_on_the_batch(tiny_model, tiny_tokenizer):
    """Four prompts in one batch or two batches of two: the same completions when each keeps its noise rows."""
    prompts = ["What is 1 + 1?", "What is 12 + 7? Answer:", "yes", "the number is"]
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    noise = torch.rand(len(prompts) * 3, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    whole = generate(tiny_model, tiny_tokenizer, prompts, 3, settings, noise=noise)
    halves = [generate(tiny_model, tiny_tokenizer, prompts[i:i + 2], 3, settings, noise=noise[3 * i:3 * i + 6])
              for i in (0, 2)]
    assert whole.completions == halves[0].completions + halves[1].completions
    assert len(set(whole.completions)) > 1  # really sampled


@pytest.mark.parametrize("variable, engine", [("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                                              ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")])
def test_other_sharded_engines_are_refused_pointing_to_fsdp(variable, engine, monkeypatch, tmp_path,
                                                            tiny_model, tiny_tokenizer):
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ValueError, match=f"with {engine} .*does not support.*--nproc N --fsdp.*ddp_gpu.yaml"):
        GRPOTrainer(tiny_model, tiny_tokenizer, lambda prompts, completions, **kw: [0.0] * len(completions),
                    GRPOConfig(output_dir=str(tmp_path)))


def two_rank_view(trainer, other_rank: dict) -> None:
    """Make a one-process trainer answer `any` as rank 0 of two would: True also when `other_rank` says the
    other rank has the flag (its reward failed, or a signal reached it), except for the check of the config
    after each step (the loop's check_config), which no callback changed on the other rank either. The other
    collectives stay local."""
    import sys

    real_any = trainer.dist.any

    def any_rank(flag):
        config_check = sys._getframe(1).f_code.co_name == "check_config"
        return real_any(flag) or (other_rank["flag"] and not config_check)

    trainer.dist.any = any_rank


def short_run_config(tmp_path) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), group_size=4, prompts_per_step=2, gradient_accumulation_steps=1,
                      max_new_tokens=6, max_steps=3, save_steps=0, logging_steps=1, learning_rate=1e-2,
                      preflight="off")


def text_length(prompts, completions, **kwargs):
    return [len(text) % 5 / 4 for text in completions]


ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def test_a_reward_failing_on_another_rank_stops_this_one_at_the_same_point(tmp_path, tiny_model, tiny_tokenizer):
    """Every rank raises RewardError after the same scoring, so rank 0 is not left waiting in a collective and
    saves the last finished step (the other ranks wait for it at a barrier before they exit)."""
    other_rank = {"flag": False}

    def reward(prompts, completions, **kwargs):
        other_rank["flag"] = trainer.global_step == 1  # the other rank's reward fails in step 2
        return text_length(prompts, completions)

    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, reward, short_run_config(tmp_path))
    two_rank_view(trainer, other_rank)
    with pytest.raises(RewardError, match=r"step 2: a reward failed in another process(.|\n)*The last finished "
                                          r"step \(1\) is saved in"):
        trainer.train(ROWS)
    assert (tmp_path / "checkpoint-1" / "COMPLETE").is_file()


def test_a_signal_to_another_rank_stops_every_rank_after_the_same_step(tmp_path, tiny_model, tiny_tokenizer):
    other_rank = {"flag": False}
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, text_length, short_run_config(tmp_path))
    two_rank_view(trainer, other_rank)
    real_update = trainer.update

    def update(batch):
        other_rank["flag"] = trainer.global_step == 1  # SIGTERM reaches the other rank during step 2
        return real_update(batch)

    trainer.update = update
    with pytest.raises(TrainingInterrupted, match=r"stopped by a signal after step 2 of 3\. The last finished step "
                                                  r"\(2\) is saved in"):
        trainer.train(ROWS)
    assert trainer.global_step == 2 and (tmp_path / "checkpoint-2" / "COMPLETE").is_file()
