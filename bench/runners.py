"""One measurement in this process: Forge or TRL, a warm-up step plus N timed optimizer steps.

`compare_trl.py` runs each measurement as `python bench/runners.py '<spec json>' <out.json>` in a fresh
process, so the peak RSS it reports (VmHWM, read right after the last timed step, before any shutdown
work) belongs to that framework alone.

What is timed, per optimizer step:
    Forge  GRPOTrainer.step(rows): generate, score, advantages, loss/backward, clip, AdamW, metrics
    TRL    on_step_begin -> on_step_end of its Trainer loop: the same phases inside training_step
Generation time wraps Forge's `_generate` and TRL's `_generate_single_turn` (the model.generate call plus
its EOS masking). Tokens forwarded counts the input ids of every forward pass (a hook on the input
embedding), so it shows how often each framework runs the prompt.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LEARNING_RATE = 1e-6
TEMPERATURE = 0.9
KL_BETA = 0.0
LOSS_TYPE = "grpo"
SEED = 0


class BenchmarkDone(Exception):
    """Raised from inside the training loop after the last timed step, so nothing else runs."""


class Recorder:
    """Per-step wall time, generation time, completion tokens and tokens forwarded."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._started = 0.0
        self.tokens_forwarded = 0
        self.peak_rss_kib: int | None = None

    def count_forward(self, module, args, kwargs=None):
        input_ids = args[0] if args else (kwargs or {}).get("input")
        if input_ids is not None:
            self.tokens_forwarded += int(input_ids.numel())

    def begin(self):
        self._current = {"gen_seconds": 0.0, "completion_tokens": 0, "prompt_tokens": 0}
        self.tokens_forwarded = 0
        self._started = time.perf_counter()
        self._cpu_started = time.process_time()

    def add_generation(self, seconds: float, completion_tokens: int, prompt_tokens: int):
        self._current["gen_seconds"] += seconds
        self._current["completion_tokens"] += completion_tokens
        self._current["prompt_tokens"] += prompt_tokens

    def end(self):
        self._current["seconds"] = time.perf_counter() - self._started
        self._current["cpu_seconds"] = time.process_time() - self._cpu_started  # all threads of this process
        self._current["tokens_forwarded"] = self.tokens_forwarded
        self.steps.append(self._current)
        if len(self.steps) == self.total_steps:
            self.peak_rss_kib = vm_hwm_kib()
            raise BenchmarkDone


def vm_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_forge(spec: dict, model, tokenizer, rows: list[dict], recorder: Recorder, output_dir: str) -> dict:
    from workloads import LORA_ALPHA, LORA_R, LORA_TARGETS, correctness_reward

    from forge import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        group_size=spec["group_size"], prompts_per_step=spec["prompts_per_step"], gradient_accumulation_steps=1,
        max_new_tokens=spec["max_new_tokens"], temperature=TEMPERATURE, top_p=1.0, top_k=0, kl_beta=KL_BETA,
        loss_type=LOSS_TYPE, scale_rewards="group", clip_epsilon=0.2, num_iterations=1,
        learning_rate=LEARNING_RATE, lr_scheduler="constant", warmup_ratio=0.0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=recorder.total_steps, shuffle=False, seed=SEED, output_dir=output_dir,
        logging_steps=10**6, save_steps=0, log_completions=0,
        dtype="auto" if spec.get("precision") == "best" else "float32",
        use_lora=spec["mode"] == "lora", lora_r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
        lora_target_modules=LORA_TARGETS, share_prompt_prefix=spec.get("share_prompt_prefix", True),
        micro_batch_size=spec["micro_batch_size"], gradient_checkpointing=spec.get("gradient_checkpointing", False),
        preflight="off",  # TRL has none; the comparison is of training steps
    )
    trainer = GRPOTrainer(model, tokenizer, reward_fn=correctness_reward, config=config)

    generate, step = trainer.sample_completions, trainer.step

    def timed_generate(prompts, *args, **kwargs):
        t0 = time.perf_counter()
        rollout = generate(prompts, *args, **kwargs)
        recorder.add_generation(time.perf_counter() - t0, int(rollout.completion_lengths.sum()),
                                int(rollout.prompt_mask.sum()) * rollout.group_size)
        return rollout

    def timed_step(step_rows):
        recorder.begin()
        metrics = step(step_rows)
        recorder.end()
        return metrics

    trainer.sample_completions, trainer.step = timed_generate, timed_step
    try:
        trainer.train(rows)
    except BenchmarkDone:
        pass
    return {"trainable_parameters": sum(p.numel() for p in trainer.trainable)}


def run_trl(spec: dict, model, tokenizer, rows: list[dict], recorder: Recorder, output_dir: str) -> dict:
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from workloads import LORA_ALPHA, LORA_R, LORA_TARGETS, correctness_reward

    from forge.model import cpu_has_bf16_units

    completions_per_step = spec["prompts_per_step"] * spec["group_size"]
    micro_batch = spec["micro_batch_size"] or completions_per_step
    if completions_per_step % micro_batch:
        raise ValueError(f"micro_batch_size={micro_batch} must divide the {completions_per_step} completions per step")
    args = trl.GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=micro_batch,  # completions per forward/backward, as Forge's micro_batch_size
        gradient_accumulation_steps=completions_per_step // micro_batch,
        generation_batch_size=completions_per_step,  # one generation of prompts x group per optimizer step
        num_generations=spec["group_size"], max_completion_length=spec["max_new_tokens"],
        temperature=TEMPERATURE, top_p=1.0, top_k=0, beta=KL_BETA, loss_type=LOSS_TYPE, scale_rewards="group",
        epsilon=0.2, num_iterations=1, mask_truncated_completions=False,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", max_steps=recorder.total_steps, seed=SEED,
        shuffle_dataset=False,
        # TRL defaults that differ from Forge's: bf16=True, gradient_checkpointing=True. Same settings here;
        # --precision best gives TRL its default bf16=True where the CPU runs bf16 fast.
        bf16=spec.get("precision") == "best" and cpu_has_bf16_units()[0], fp16=False,
        gradient_checkpointing=False, use_cpu=True, use_vllm=False,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", log_completions=False,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    peft_config = None
    if spec["mode"] == "lora":
        peft_config = LoraConfig(task_type="CAUSAL_LM", r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                 target_modules=LORA_TARGETS)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            recorder.begin()

        def on_step_end(self, args, state, control, **kwargs):
            recorder.end()

    trainer = trl.GRPOTrainer(model=model, reward_funcs=correctness_reward, args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                              peft_config=peft_config, callbacks=[StepTimer()])
    generate_single_turn = trainer._generate_single_turn

    def timed_generate(prompt_ids, *a, **kw):
        t0 = time.perf_counter()
        completion_ids, logprobs = generate_single_turn(prompt_ids, *a, **kw)
        recorder.add_generation(time.perf_counter() - t0, sum(len(c) for c in completion_ids),
                                sum(len(p) for p in prompt_ids))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    try:
        trainer.train()
    except BenchmarkDone:
        pass
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"trainable_parameters": trainable, "trl": trl.__version__}


def measure(spec: dict) -> dict:
    """spec: framework, workload, model, mode, group_size, prompts_per_step, max_new_tokens, steps (timed),
    warmup, threads, fixed_length, one_token_prompt."""
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(SEED)
    from workloads import dataset_rows, load_model, suppress_eos

    t0 = time.perf_counter()
    model, tokenizer = load_model(spec["model"], spec["workload"])
    if spec["fixed_length"]:
        suppress_eos(model, tokenizer)
    total_steps = spec["warmup"] + spec["steps"]
    rows = dataset_rows(spec["workload"], max(20, total_steps * spec["prompts_per_step"]),
                        one_token_prompt=spec.get("one_token_prompt", False), tokenizer=tokenizer)
    recorder = Recorder(total_steps)
    hook = model.get_input_embeddings().register_forward_pre_hook(recorder.count_forward)
    runner = {"forge": run_forge, "trl": run_trl}[spec["framework"]]
    with tempfile.TemporaryDirectory(prefix=f"bench_{spec['framework']}_") as output_dir:
        extra = runner(spec, model, tokenizer, rows, recorder, output_dir)
    hook.remove()
    if len(recorder.steps) != total_steps:
        raise RuntimeError(f"{spec['framework']} ran {len(recorder.steps)} steps, expected {total_steps}")
    return {"spec": spec, "steps": recorder.steps, "warmup": spec["warmup"], "peak_rss_kib": recorder.peak_rss_kib,
            "wall_seconds": time.perf_counter() - t0, **extra}


def main() -> None:
    spec, out_path = json.loads(sys.argv[1]), sys.argv[2]
    result = measure(spec)
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
