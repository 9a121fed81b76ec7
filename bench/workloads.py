"""The benchmark's workloads, models and reward: one definition that both frameworks read.

A workload is a set of dataset rows plus the shape of one optimizer step (prompts per step, group
size, max new tokens). Both Forge and TRL get the same rows in the same order (no shuffling), so
optimizer step k of either framework sees the same prompts.

Fixed-length completions: the tiny random-init model would stop at a random EOS, so its completion
lengths, and so its cost, would differ between frameworks and runs. `suppress_eos` makes EOS
unreachable instead: it adds one new special token to the tokenizer, whose id (= the model's
vocabulary size) is past the model's output layer, and makes it the tokenizer's and the generation
config's only EOS. Neither framework can ever sample it, so every completion is exactly
max_new_tokens long, and nothing about the model or the sampling distribution changes. (The old
EOS, e.g. SmolLM2's <|im_end|>, stays an ordinary token that the pad id may still point at; both
frameworks build completion masks from the EOS position, not from the pad id.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

NEVER_EOS = "<|bench_never_eos|>"
SMOLLM2_DIR = Path.home() / ".cache" / "forge" / "models" / "smollm2-135m-instruct"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_R, LORA_ALPHA = 16, 32


@dataclass(frozen=True)
class Workload:
    name: str
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    micro_batch_size: int
    """Completions per forward/backward in the loss, the same in both frameworks (Forge micro_batch_size,
    TRL per_device_train_batch_size with gradient accumulation up to one rollout). The whole rollout in one
    pass does not fit this machine's memory in TRL, which runs every completion with its full prompt."""
    description: str


WORKLOADS = {
    "short": Workload("short", prompts_per_step=4, group_size=8, max_new_tokens=64, micro_batch_size=8,
                      description="arithmetic chat prompts: system prompt + two worked examples "
                                  "(forge.data.arithmetic.chat_prompt)"),
    "long": Workload("long", prompts_per_step=2, group_size=8, max_new_tokens=128, micro_batch_size=4,
                     description="GSM8K-format prompts with four worked examples "
                                 "(forge.data.gsm8k.few_shot_gsm8k_prompt)"),
}


def dataset_rows(workload: str, n: int, one_token_prompt: bool = False, tokenizer=None) -> list[dict]:
    """`n` rows {"prompt", "reference"} in a fixed order.

    one_token_prompt: replace every prompt by a single-token string (the first token of the real
    prompt), to measure what the prompt costs; needs the tokenizer.
    """
    if workload == "short":
        from forge.data.arithmetic import arithmetic_dataset

        rows = [{"prompt": r["prompt"], "reference": r["reference"]} for r in arithmetic_dataset(n, seed=0)]
    elif workload == "long":
        from forge.data.gsm8k import few_shot_gsm8k_prompt, load_gsm8k_mock

        rows = [{"prompt": few_shot_gsm8k_prompt(r["question"], n_shots=4), "reference": r["reference"]}
                for r in load_gsm8k_mock(n)]
    else:
        raise ValueError(f"unknown workload {workload!r}; choose one of {sorted(WORKLOADS)}")
    if one_token_prompt:
        rows = [{"prompt": one_token_text(tokenizer, r["prompt"]), "reference": r["reference"]} for r in rows]
    return rows


def one_token_text(tokenizer, prompt) -> str:
    """A plain-text prompt that tokenizes to exactly one token: the first token of `prompt`."""
    from forge.core.rollout import render_prompt

    first = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"][0]
    text = tokenizer.decode([first])
    if len(tokenizer(text)["input_ids"]) != 1:
        raise ValueError(f"the first token {text!r} does not re-tokenize to one token")
    return text


def load_model(name: str, workload: str):
    """(model, tokenizer) in fp32, in eval mode, dropout 0. name: 'tiny' or 'smollm2'."""
    from forge.model import load_model as forge_load_model

    if name == "tiny":
        from forge.model.tiny import build_tiny_model

        model, tokenizer = build_tiny_model(seed=0)
        # The long workload's prompt is ~1,300 tokens under the tiny 320-token BPE vocabulary, over the tiny
        # model's 512 positions. Rotary embeddings have no table, so raising the limit changes nothing else.
        model.config.max_position_embeddings = 4096
    elif name == "smollm2":
        source = str(SMOLLM2_DIR) if SMOLLM2_DIR.is_dir() else "default"
        model, tokenizer = forge_load_model(source, dtype="float32")
    else:
        raise ValueError(f"unknown model {name!r}; choose 'tiny' or 'smollm2'")
    model = model.float().eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def suppress_eos(model, tokenizer) -> int:
    """Make EOS unreachable (see the module docstring); returns the new EOS id."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(tokenizer) != vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model outputs {vocab}; the unreachable-EOS "
                         f"trick needs the new token to land exactly at id {vocab}")
    pad_token = tokenizer.pad_token
    tokenizer.add_special_tokens({"eos_token": NEVER_EOS})
    tokenizer.pad_token = pad_token  # keep the old pad (it may be the old EOS: now an ordinary token)
    never = tokenizer.convert_tokens_to_ids(NEVER_EOS)
    assert never == vocab, (never, vocab)
    model.generation_config.eos_token_id = never
    model.config.eos_token_id = never
    return never


def completion_text(completion) -> str:
    """TRL hands conversational completions over as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return str(completion)


def correctness_reward(prompts, completions, references=None, reference=None, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the reference. Forge passes the dataset's
    `reference` column as `references=`, TRL as `reference=`; both land here."""
    from forge.core.reward import MathCorrectnessReward

    refs = references if references is not None else reference
    texts = [completion_text(c) for c in completions]
    return MathCorrectnessReward()(list(prompts), texts, references=refs).scores


def demo_trainer(output_dir: str, **settings):
    """The demo's trainer (packaged SmolLM2-135M, its LoRA recipe; DemoSettings fields as keywords) with random
    B matrices (seeded), so its adapter path computes what a trained adapter does, and the demo's first prompts."""
    from forge.core.trainer import GRPOTrainer
    from forge.data.arithmetic import arithmetic_dataset
    from forge.demo import DemoSettings, demo_config, demo_rewards
    from forge.model import load_model as load_forge_model

    demo = DemoSettings(seed=0, **settings)
    model, tokenizer = load_forge_model("default")
    trainer = GRPOTrainer(model, tokenizer, demo_rewards(), demo_config(demo, output_dir))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
    prompts = [row["prompt"] for row in arithmetic_dataset(n=demo.prompts_per_step, seed=0, chat=True)]
    return trainer, prompts


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (forge.model.cpu_name)."""
    from forge.model import cpu_name

    return cpu_name()


def machine_info(threads: int) -> dict:
    import os
    import platform

    import transformers

    info = {"cpu_cores": os.cpu_count(), "torch_threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_model": cpu_model()}
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    info["git"] = _git_state()
    return info


def _git_state() -> str:
    """HEAD commit, plus '+dirty (files)' when forge/ has uncommitted changes: what was measured."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "forge"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = sorted(line[3:] for line in dirty if line.strip())
    return head + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")
