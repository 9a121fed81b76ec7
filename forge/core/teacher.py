"""The teacher of on-policy distillation: loading it, checking its tokenizer, and its pass over the rollouts.

The teacher scores the student's own sampled tokens in the same pass as the reference (core/logprobs.py
through GRPOTrainer.rollout_logprobs: the shared prompt once per group, logits chunk by chunk), and
core/distill.py turns its log-probs and the student's into per-token advantages. A teacher is one of

    a model id or folder          loaded like the policy (forge/model/loading.py), moved to the student's
                                  device
    a loaded model                used as it is (GRPOTrainer(..., teacher_model=model))
    a LoRA adapter folder         with a LoRA student on the same base: loaded as the student's second adapter
                                  "teacher" and switched on for its pass, so the base weights exist once; with
                                  a full fine-tuning student, its base is loaded and the adapter put on it

Their tokenizers must map the same strings to the same ids, or the teacher's log-probs would be of other
tokens: checked before the first step, with an error that names the first difference.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
from transformers import AutoTokenizer

from forge.core.batch import Batch
from forge.core.distill import distillation_advantages, divergence_loss, reverse_kl_sums
from forge.core.logprobs import (
    TeacherStates,
    completion_states,
    completions_of,
    logit_head,
    micro_batches,
    padded_rows,
)
from forge.model import is_peft_model, load_model
from forge.model.lora import quiet_checkpointing_deprecation
from forge.safe_json import read_json

TEACHER_ADAPTER = "teacher"  # the name of a teacher adapter inside the student's PeftModel


class Teacher:
    """A teacher model (or the student's own "teacher" adapter), the coefficients of its signal and how it is
    taken (distill_loss: 'sampled', a per-token advantage; 'full', a divergence term of the loss with GKD's
    beta)."""

    def __init__(self, model, adapter: str | None, distill_coef: float, reward_coef: float,
                 loss: str = "sampled", beta: float = 1.0):
        self.model, self.adapter = model, adapter  # adapter: the student's adapter to switch on, else None
        self.distill_coef, self.reward_coef = distill_coef, reward_coef
        self.full, self.beta = loss == "full", beta
        self.head = logit_head(model) if self.full else None  # the teacher's output layer
        if self.full and (self.head is None or hasattr(self.head, "base_layer")):
            raise ValueError("distill_loss='full' makes the teacher's logits chunk by chunk from its hidden "
                             "states, so its logits must be a plain output layer of them (not scaled or "
                             "capped, not a LoRA-wrapped lm_head); use distill_loss='sampled'")

    def switched_on(self):
        """The teacher's adapter switched on in the student (a context), or nothing for a model of its own."""
        return active_adapter(self.model, self.adapter) if self.adapter else nullcontext()

    @torch.no_grad()
    def logprobs(self, rollout, rollout_logprobs: Callable,
                 indices: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T) log p_teacher of every sampled token of a rollout, or of its completions `indices` only (0
        elsewhere) (rollout_logprobs: GRPOTrainer's)."""
        with self.switched_on():
            return rollout_logprobs(self.model, rollout, indices)

    def advantages(self, batch: Batch, trainer, stats) -> list[torch.Tensor]:
        """(N, T) per-token advantages of each rollout of the batch (core/distill.py): its reward advantages
        (N,) combined with the teacher's sampled signal. The student's log-probs are those that sampled:
        pi_old when the batch has them, else the sampler's, else a pass of the student. The reverse KL and
        the teacher pass's seconds go into `stats` (forge/run/step_stats.py RolloutStats); the passes are the
        GRPOTrainer `trainer`'s. With distill_loss='full' the advantages are the reward's alone and the
        teacher's pass keeps its hidden states for the loss pass instead (batch.teacher_hidden)."""
        student, rollout_logprobs = trainer.model, trainer.rollout_logprobs
        if self.full:
            return self.keep_states(batch, partial(rollout_states, trainer), stats)
        advantages = []
        for r, rollout in enumerate(batch.rollouts):
            started = time.perf_counter()
            teacher_logprobs = self.logprobs(rollout, rollout_logprobs, batch.loss_indices[r])  # (N, T)
            stats.teacher_seconds += time.perf_counter() - started
            student_logprobs = sampled_logprobs(batch.old_logprobs[r], rollout, student, rollout_logprobs,
                                                batch.loss_indices[r])  # (N, T)
            mask = batch.loss_mask[r]  # (N, T)
            advantages.append(distillation_advantages(batch.advantages[r], student_logprobs, teacher_logprobs,
                                                      mask, distill_coef=self.distill_coef,
                                                      reward_coef=self.reward_coef))
            kl = reverse_kl_sums(student_logprobs, teacher_logprobs, mask)
            stats.distill_kl.append(kl.per_sequence)
            stats.distill_tokens.append(kl.tokens)
        return advantages

    def keep_states(self, batch: Batch, states_of: Callable, stats) -> list[torch.Tensor]:
        """distill_loss='full': the teacher's hidden states of each rollout's loss completions into
        batch.teacher_hidden (states_of(model, rollout, indices): rollout_states); returns the reward
        advantages (N,) x reward_coef."""
        started = time.perf_counter()
        with self.switched_on():
            batch.teacher_hidden = [states_of(self.model, rollout, indices)
                                    for rollout, indices in zip(batch.rollouts, batch.loss_indices)]
        stats.teacher_seconds += time.perf_counter() - started
        return [self.reward_coef * advantages for advantages in batch.advantages]

    def view(self, batch: Batch, r: int, indices: torch.Tensor) -> TeacherStates | None:
        """distill_loss='full': the teacher's states of rollout r's completions `indices` for the loss pass,
        on the teacher's device (the student's); None with distill_loss='sampled'."""
        if not self.full:
            return None
        device = self.head.weight.device
        return TeacherStates(batch.teacher_hidden[r][indices].to(device), self.head, self.beta)

    def loss(self, divergence: torch.Tensor, mask: torch.Tensor, num_tokens: float, totals) -> torch.Tensor:
        """distill_coef x the micro-batch's share of the mean divergence (n, T) over the step's loss tokens
        (mask (n, T)); the divergence is logged through `totals` (forge/run/step_stats.py UpdateTotals)."""
        totals.add_divergence(divergence, mask)
        return self.distill_coef * divergence_loss(divergence, mask, num_tokens)


def rollout_states(trainer, model, rollout, indices: torch.Tensor | None = None) -> torch.Tensor:
    """(N, T, H) `model`'s last hidden states before each token of a rollout's completions
    (completion_states), micro-batch by micro-batch in the GRPOTrainer `trainer`'s precision, on CPU: of the
    completions `indices` only (0 elsewhere) when given. Whole weights: a run with a teacher is unsharded."""
    batches = micro_batches(rollout, trainer.micro_batch_size, indices)
    parts = []
    for batch in batches:
        completions, index = completions_of(rollout, batch)
        with trainer.precision.autocast(model):
            parts.append(completion_states(model, rollout.prompt_ids, rollout.prompt_mask, completions,
                                           index))
    return padded_rows(parts, rollout.completion_ids, batches)


def sampled_logprobs(old_logprobs, rollout, student, rollout_logprobs: Callable,
                     indices: torch.Tensor | None = None) -> torch.Tensor:
    """(N, T) the student's log-probs of its sampled tokens as they were sampled: pi_old when the step
    computed it, else the sampler's record (at the sampling temperature), else a no-grad pass of `student`
    (over the completions `indices` only when given)."""
    for recorded in (old_logprobs, rollout.sampler_logprobs):
        if recorded is not None:
            return recorded
    with torch.no_grad():
        return rollout_logprobs(student, rollout, indices)


@contextmanager
def active_adapter(model, name: str) -> Iterator[None]:
    """The PeftModel `model` with only adapter `name` switched on; the previous adapter (and every parameter's
    requires_grad, which peft's set_adapter changes) restored after."""
    previous = model.active_adapter
    trainable = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(previous)
        for parameter, flag in trainable:
            parameter.requires_grad_(flag)


def open_teacher(config, student, tokenizer, teacher_model=None) -> Teacher | None:
    """The run's teacher (teacher_model, else config.teacher_model), its tokenizer checked against the
    student's; None without one."""
    source = config.teacher_model if teacher_model is None else teacher_model
    if source is None:
        if config.group_size < 2:
            raise ValueError(f"group_size={config.group_size}: GRPO needs >= 2 completions per prompt; one "
                             f"per prompt is for pure on-policy distillation, which needs a teacher_model")
        return None
    if config.distill_loss == "full" and logit_head(student) is None:
        raise ValueError(f"distill_loss='full' makes the student's logits chunk by chunk from its hidden "
                         f"states, but {type(student).__name__} scales or caps its logits after its output "
                         f"layer; use distill_loss='sampled'")
    device = next(student.parameters()).device
    if not isinstance(source, str | os.PathLike):  # a loaded model
        model, adapter = source.to(device), None
        check_vocabulary(tokenizer, _saved_tokenizer(getattr(model.config, "_name_or_path", "")), model)
    elif (Path(source) / "adapter_config.json").is_file():
        model, adapter = _adapter_teacher(Path(source), student, tokenizer, device)
    else:
        model, teacher_tokenizer = load_model(source, device=device)
        adapter = None
        check_vocabulary(tokenizer, teacher_tokenizer, model)
    if adapter is None:
        model.eval().requires_grad_(False)
    return Teacher(model, adapter, config.distill_coef, config.reward_coef, config.distill_loss,
                   config.distill_beta)


def _adapter_teacher(path: Path, student, tokenizer, device):
    """(model, adapter name or None) of a LoRA adapter folder: the student's second adapter when the student
    is a LoRA model of the adapter's base, else the base loaded with the adapter on it."""
    base = read_json(path / "adapter_config.json").get("base_model_name_or_path") or ""
    check_vocabulary(tokenizer, _saved_tokenizer(path) or _saved_tokenizer(base), None)
    if is_peft_model(student):
        student_base = getattr(student.get_base_model().config, "_name_or_path", "")
        if base and student_base and os.path.realpath(base) != os.path.realpath(student_base):
            raise ValueError(f"teacher_model={str(path)!r} is a LoRA adapter of {base!r}, but the student's "
                             f"base is {student_base!r}: a teacher adapter must be trained on the student's "
                             f"own base (or merge it into its base and pass that folder)")
        student.load_adapter(str(path), adapter_name=TEACHER_ADAPTER, is_trainable=False)
        return student, TEACHER_ADAPTER
    from peft import PeftModel  # optional dependency

    model, _ = load_model(base, device=device)
    with quiet_checkpointing_deprecation():  # peft reads transformers' deprecated is_gradient_checkpointing
        return PeftModel.from_pretrained(model, str(path), is_trainable=False).to(device), None


def _saved_tokenizer(folder) -> object | None:
    """The tokenizer saved in a local folder, or None when there is none."""
    if not folder or not (Path(folder) / "tokenizer_config.json").is_file():
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def check_vocabulary(student_tokenizer, teacher_tokenizer, teacher_model) -> None:
    """Raise ValueError unless the teacher scores the student's token ids: the same vocabulary (string -> id)
    when the teacher's tokenizer is known, and in any case an output layer with a row for every student id."""
    if teacher_tokenizer is not None:
        student_vocab, teacher_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
        if student_vocab != teacher_vocab:
            differing = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()),
                               key=lambda kv: kv[1])[:3]
            raise ValueError(f"the teacher's tokenizer differs from the student's ({len(teacher_vocab)} vs "
                             f"{len(student_vocab)} tokens; e.g. {differing}): on-policy distillation scores "
                             f"the student's token ids with the teacher, so both must use the same tokenizer")
    rows = None if teacher_model is None else teacher_model.get_output_embeddings().weight.shape[0]
    if rows is not None and rows < len(student_tokenizer):
        raise ValueError(f"the teacher's output layer has {rows} rows but the student's tokenizer has "
                         f"{len(student_tokenizer)} tokens: the teacher cannot score every student token id")
