"""FSDP2 training (fsdp=True): 2 CPU processes (gloo) shard the model and train exactly like data-parallel.

The runs fully fine-tune the tiny model saved to a folder, with the KL term (so the frozen reference is sharded
too), the DAPO token-mean loss, batch-std advantages, two rollout batches per optimizer step and micro-batches
that split groups:

    data_parallel   2 processes, whole model on each (Forge's gradient all-reduce)
    sharded         2 processes with --fsdp (FSDP2's reduce-scatter), the same config and seed
    killed          the sharded run, with rank 0 (rank 1: slow) SIGKILLed inside step 3's reward, then
                    `--nproc 2 --fsdp --resume`

Checked: each rank holds half of the parameters; after every step the sharded run's whole weights equal the
data-parallel run's within fp32 rounding, with the same completions and logged metrics; checkpoints hold
the shards (sharded/) and final/ loads in plain transformers with the trained weights; the killed run
resumes from its step-2 checkpoint and ends bit for bit where the uninterrupted run ends; a shard file of the
sharded run's newest checkpoint cut, emptied or overwritten (COMPLETE rewritten to match or not) stops
`--resume` in one line naming the file. LoRA under FSDP2 is compared with a one-process LoRA run. In one
process: the launch settings that turn FSDP on or are refused, and the checkpoint kinds that cannot be resumed
across.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import read_jsonl, write_workspace

from forge.cli import main as forge_main
from forge.parallel.distributed import DataParallel, OneProcess
from forge.run.integrity import verify_checkpoint, write_manifest
from forge.run.lifecycle import check_same_sharding

STEPS = 4
TESTS_DIR = Path(__file__).parent

REWARD_FILE = '''
import os
import signal

CALLS = [0]


def text_length(prompts, completions, **kwargs):
    """Varies inside a group; SIGKILLs rank FORGE_TEST_KILL_RANK at its FORGE_TEST_KILL_AT-th call (2 calls per
    step here)."""
    CALLS[0] += 1
    if os.environ.get("RANK", "0") == os.environ.get("FORGE_TEST_KILL_RANK") and \
            CALLS[0] == int(os.environ.get("FORGE_TEST_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return [len(text) % 7 / 6 for text in completions]
'''

# torch.distributed.run starts this file in each process: forge train, with every step's weights recorded.
DRIVER_FILE = '''
import os, sys
sys.path.insert(0, {tests_dir!r})
from test_fsdp import install_recorder
from forge.cli import main

install_recorder(os.environ["FORGE_TEST_RECORD"], int(os.environ["RANK"]))
sys.exit(main(sys.argv[1:]))
'''


def install_recorder(record_dir: str, rank: int) -> None:
    """After each step, rank r writes {record_dir}/rank{r}-step{s}.pt: the whole trainable weights (gathered
    from the shards under FSDP2) and how many of their elements this rank holds."""
    from forge.core.trainer import GRPOTrainer
    from forge.parallel.sharding import local

    real_step = GRPOTrainer.step

    def recorded_step(self, rows):
        metrics = real_step(self, rows)
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.trainable]  # collective
        torch.save({"weights": torch.cat([w.detach().flatten() for w in whole]),
                    "held": sum(local(p).numel() for p in self.trainable)},
                   Path(record_dir) / f"rank{rank}-step{self.global_step}.pt")
        return metrics

    GRPOTrainer.step = recorded_step


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_workspace(tmp_path_factory.mktemp("fsdp"), REWARD_FILE, DRIVER_FILE)


def train_args(root: Path, output_dir: Path, *extra: str) -> list[str]:
    """One optimizer step = 2 rollout batches of 4 prompts x 4 completions; with 2 ranks, 2 prompts each."""
    return ["train", "--model", str(root / "tiny"), "--dataset", str(root / "data.jsonl"),
            "--reward", f"{root / 'rewards.py'}:text_length", "--output_dir", str(output_dir),
            "--group_size", "4", "--prompts_per_step", "4", "--gradient_accumulation_steps", "2",
            "--micro_batch_size", "3", "--max_new_tokens", "8", "--max_steps", str(STEPS), "--save_steps", "2",
            "--logging_steps", "1", "--log_completions", "8", "--kl_beta", "0.05", "--loss_type", "dapo",
            "--scale_rewards", "batch", "--learning_rate", "0.01", "--seed", "5", "--preflight", "off", *extra]


def launch(root: Path, name: str, *extra: str, kill_at: int = 0, kill_rank: int = 0) -> subprocess.CompletedProcess:
    record = root / f"record-{name}"
    record.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS_DIR.parents[1]),
           "FORGE_TEST_RECORD": str(record), "FORGE_TEST_KILL_AT": str(kill_at),
           "FORGE_TEST_KILL_RANK": str(kill_rank)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(root / "driver.py"), *train_args(root, root / name, *extra)]
    return subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=600)


def succeeded(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def data_parallel(workspace):
    succeeded(launch(workspace, "data_parallel"))
    return workspace / "data_parallel", workspace / "record-data_parallel"


@pytest.fixture(scope="module")
def sharded(workspace):
    succeeded(launch(workspace, "sharded", "--fsdp"))
    return workspace / "sharded", workspace / "record-sharded"


def test_each_rank_holds_half_of_the_parameters(sharded, data_parallel):
    _, record = sharded
    _, dp_record = data_parallel
    total = torch.load(record / "rank0-step1.pt")["weights"].numel()
    held = [torch.load(record / f"rank{rank}-step1.pt")["held"] for rank in (0, 1)]
    assert sum(held) == total and max(held) - min(held) <= total * 0.01, (held, total)
    assert torch.load(dp_record / "rank1-step1.pt")["held"] == total  # data-parallel: the whole model each


def test_sharded_training_equals_data_parallel_training(sharded, data_parallel):
    run, record = sharded
    dp_run, dp_record = data_parallel
    start = load_file(run.parent / "tiny" / "model.safetensors")
    for step in range(1, STEPS + 1):
        fsdp_weights = torch.load(record / f"rank0-step{step}.pt")["weights"]
        assert torch.equal(fsdp_weights, torch.load(record / f"rank1-step{step}.pt")["weights"])
        dp_weights = torch.load(dp_record / f"rank0-step{step}.pt")["weights"]
        # fp32 sums in another order (reduce-scatter vs all-reduce): up to 2e-6 apart on an AVX512 Xeon, against
        # Adam steps of ~1e-2 at this learning rate
        assert torch.allclose(fsdp_weights, dp_weights, rtol=1e-5, atol=5e-6), \
            f"step {step}: max weight difference {float((fsdp_weights - dp_weights).abs().max())}"
    moved = torch.cat([t.flatten() for t in start.values()]).sort().values
    assert not torch.equal(moved, fsdp_weights.sort().values), "training did not move the weights"
    assert read_jsonl(run / "samples.jsonl") == read_jsonl(dp_run / "samples.jsonl")  # the same completions
    for mine, theirs in zip(read_jsonl(run / "training_log.jsonl"), read_jsonl(dp_run / "training_log.jsonl"),
                            strict=True):
        for key in ("loss", "kl", "grad_norm", "param_delta_norm", "reward"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), f"step {mine['step']}: {key}"
    assert mine["grad_norm"] > 0 and mine["kl"] > 0


def test_sharded_checkpoints_hold_shards_and_final_loads_in_plain_transformers(sharded):
    from transformers import AutoModelForCausalLM

    run, record = sharded
    assert sorted(p.name for p in (run / "checkpoint-2" / "sharded").iterdir()) == [
        "layout.json", "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert not (run / "checkpoint-2" / "model.safetensors").exists()
    assert not (run / "checkpoint-2" / "optimizer.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert json.loads((run / "final" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    trained = torch.load(record / f"rank0-step{STEPS}.pt")["weights"]
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), trained)
    # final/ is the trained model: the whole weights, no shards, no optimizer, scheduler or RNG state
    assert not {"sharded", "scheduler.safetensors", "rng_state.safetensors"} & {p.name for p in (run / "final").iterdir()}
    assert verify_checkpoint(run / "final", require_training_state=False)


@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_killed_sharded_run_resumes_bit_for_bit(workspace, sharded, rank):
    """kill -9 of one rank in step 3, then `forge train --nproc 2 --fsdp --resume` from the step-2 shards."""
    run, _ = sharded
    name = "killed" if rank == 0 else f"killed-rank{rank}"
    killed = launch(workspace, name, "--fsdp", kill_at=5, kill_rank=rank)  # 2 reward calls per step: the 5th is
    assert killed.returncode != 0  # in step 3
    assert sorted(p.name for p in (workspace / name).iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS_DIR.parents[1])}
    resumed = subprocess.run([sys.executable, "-m", "forge", *train_args(workspace, workspace / name, "--fsdp"),
                              "--nproc", "2", "--resume"], check=False, env=env, capture_output=True, text=True,
                             timeout=600)
    succeeded(resumed)
    assert "resumed from step 2" in resumed.stdout + resumed.stderr
    expected = load_file(run / "final" / "model.safetensors")
    got = load_file(workspace / name / "final" / "model.safetensors")
    assert expected.keys() == got.keys()
    for tensor in expected:
        assert torch.equal(got[tensor], expected[tensor]), tensor
    log = read_jsonl(workspace / name / "training_log.jsonl")
    assert [row["step"] for row in log] == list(range(1, STEPS + 1))
    assert log[-1]["loss"] == read_jsonl(run / "training_log.jsonl")[-1]["loss"]


SHARD = "sharded/shard-00002-model-00001-of-00001.safetensors"  # rank 1's
DAMAGES = {"truncated": lambda data: data[:len(data) // 2], "emptied": lambda data: b"",
           "garbage": lambda data: bytes(range(256)) * (len(data) // 256) + bytes(len(data) % 256)}


@pytest.mark.parametrize("damage, rehashed", [
    pytest.param(damage, rehashed, id=f"{damage}-{'COMPLETE-rewritten' if rehashed else 'as-damaged'}",
                 marks=() if (damage, rehashed) in {("truncated", False), ("garbage", True)} else pytest.mark.slow)
    for damage in DAMAGES for rehashed in (False, True)])
def test_a_damaged_shard_stops_the_resume_in_one_line_naming_the_file(workspace, sharded, tmp_path, damage,
                                                                        rehashed):
    """A shard file of the newest checkpoint of a finished FSDP2 run cut in half, emptied, or overwritten with
    other bytes of its size (with COMPLETE rewritten to match, as whoever hands over a checkpoint can, or not);
    then `forge train --nproc 2 --fsdp --resume`."""
    run, _ = sharded
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shard = copy / "checkpoint-4" / SHARD
    shard.write_bytes(DAMAGES[damage](shard.read_bytes()))
    if rehashed:
        write_manifest(copy / "checkpoint-4")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS_DIR.parents[1])}
    done = subprocess.run([sys.executable, "-m", "forge", *train_args(workspace, copy, "--fsdp"), "--nproc", "2",
                           "--resume"], check=False, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if line.startswith("forge: error")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"forge: error: checkpoint {copy / 'checkpoint-4'} is "
                                                     f"damaged: {SHARD} "), done.stderr[-3000:]
    assert f"The newest older checkpoint that verifies is {copy / 'checkpoint-2'}" in errors[0]
    assert "Traceback" not in done.stderr and "torch.distributed" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_damaged_shard_that_complete_matches_is_named_by_each_process_of_a_torchrun_resume(workspace, sharded,
                                                                                                tmp_path):
    """The same, resumed by torch.distributed.run itself (torchrun, as accelerate launches): no `forge train`
    checks the checkpoint first, so each process refuses it, naming the file, before torch reads a shard."""
    run, _ = sharded
    shutil.copytree(run, workspace / "torchrun-damaged")
    shard = workspace / "torchrun-damaged" / "checkpoint-4" / SHARD
    shard.write_bytes(DAMAGES["truncated"](shard.read_bytes()))
    write_manifest(shard.parents[1])
    done = launch(workspace, "torchrun-damaged", "--fsdp", "--resume")
    errors = [line for line in done.stderr.splitlines() if line.startswith("forge: error")]
    assert done.returncode != 0 and len(errors) == 2, done.stderr[-3000:]
    assert all(f"is damaged: {SHARD} is truncated" in line for line in errors), done.stderr[-3000:]
    assert "SafetensorError" not in done.stderr, done.stderr[-3000:]


def test_lora_with_two_updates_per_rollout_under_fsdp_trains_like_one_process(workspace):
    lora = ["--use_lora", "--lora_r", "4", "--learning_rate", "0.05", "--max_steps", "4", "--save_steps", "0",
            "--num_iterations", "2"]  # pi_old log-probs too
    succeeded(launch(workspace, "lora_sharded", "--fsdp", *lora))
    assert forge_main(train_args(workspace, workspace / "lora_single", *lora)) == 0
    sharded_adapter = load_file(workspace / "lora_sharded" / "final" / "adapter_model.safetensors")
    single_adapter = load_file(workspace / "lora_single" / "final" / "adapter_model.safetensors")
    assert sharded_adapter.keys() == single_adapter.keys()
    for name, value in single_adapter.items():
        assert torch.allclose(sharded_adapter[name], value, rtol=1e-4, atol=1e-6), name
    assert read_jsonl(workspace / "lora_sharded" / "samples.jsonl") == \
        read_jsonl(workspace / "lora_single" / "samples.jsonl")


# ----------------------------------------------------------------------------------------------------
# in one process


def test_accelerate_fsdp2_launch_turns_fsdp_on_and_fsdp1_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="FSDP version 1.*fsdp_version: 2.*--nproc N --fsdp"):
        DataParallel()
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.warns(UserWarning, match="one process: there is nothing to shard"):
        dist = DataParallel()
    assert not dist.fsdp and dist.world_size == 1  # one process trains whole, as without fsdp


def test_one_process_is_a_one_process_whose_collectives_return_what_they_are_given(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist = DataParallel()
    assert isinstance(dist, OneProcess) and dist.world_size == 1 and dist.is_main and not dist.fsdp
    grads = torch.arange(3.0)
    assert dist.gather(grads) is grads and dist.local_shards([grads])[0] is grads
    assert dist.sum([1.0, 2.0]) == [1.0, 2.0] == dist.sum_shards([1.0, 2.0]) and dist.max(0.5) == 0.5
    assert dist.any(True) is True and dist.any(False) is False
    assert dist.gather_objects("samples") == ["samples"] and dist.main_pid == os.getpid()
    assert dist.my_share(list(range(8)), 2, group=4) == list(range(8))  # the whole round
    assert dist.loss_indices(torch.tensor([[1, 0], [0, 0], [0, 1]])).tolist() == [0, 2]


def test_sharded_and_whole_checkpoints_refuse_to_resume_across(tmp_path):
    sharded_checkpoint = tmp_path / "sharded_run" / "checkpoint-2"
    whole_checkpoint = tmp_path / "whole_run" / "checkpoint-2"
    (sharded_checkpoint / "sharded").mkdir(parents=True)
    (sharded_checkpoint / "sharded" / "layout.json").write_text("{}")
    whole_checkpoint.mkdir(parents=True)
    with pytest.raises(ValueError, match="saved by an FSDP run.*--nproc N --fsdp"):
        check_same_sharding(sharded_checkpoint, sharded=False)
    with pytest.raises(ValueError, match="with --fsdp: it was saved by a run without FSDP"):
        check_same_sharding(whole_checkpoint, sharded=True)
    check_same_sharding(sharded_checkpoint, sharded=True)
    check_same_sharding(whole_checkpoint, sharded=False)
