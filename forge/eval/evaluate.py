"""Evaluate a model on held-out problems: batched generation, strict/soft accuracy, format rate, pass@k,
maj@k.

Problems are generated in chunks of `batch_size` prompts with `forge.core.rollout.generate`, the same batched
decoder the trainer samples with, and each response is graded by `forge.eval.metrics.grade`, which uses the
answer extraction and `answers_match` of the training rewards. Greedy decoding (the default) gives one
deterministic answer per problem; with `num_samples > 1` and a temperature, each problem gets that many
samples and pass@k / maj@k are reported (see `forge.eval.metrics` for the estimators).

Evaluation does not disturb training: the model's train/eval mode and the global torch RNG state are
restored afterwards, so calling `evaluate` in the middle of a run does not change the run's later samples.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from forge.core.config import GRPOConfig, require_vllm
from forge.core.engine_rollout import colocated_engine, generate_on_engine
from forge.core.evaluator import greedy_reward_evaluator
from forge.core.reward_sources import build_reward_list
from forge.core.rollout import Rollout, SamplingSettings, generate, sampling_noise
from forge.data.answers import answers_match, readable_reference
from forge.data.dataset import as_chat_rows, load_rows, pick_chat, task_for, warn_if_raw_prompts
from forge.data.hf_dataset import load_hf_rows
from forge.data.reasoning_gym_tasks import task_scorer
from forge.eval.metrics import (
    ANSWER_FORMATS,
    CORRECT,
    NO_ANSWER,
    WRONG_ANSWER,
    Grade,
    detect_answer_format,
    grade,
    majority_vote,
    pass_at_k,
)
from forge.model import load_for_eval, merged_adapters


@dataclass
class EvalResult:
    """What `evaluate` measured: aggregate metrics, and one record per problem with every response."""

    metrics: dict[str, float]
    """strict_accuracy, soft_accuracy, format_rate, mean_completion_length (tokens), frac_truncated,
    nonempty_rate (share of responses with any text), n (problems), num_samples, seconds; task_score (mean
    score of the task's own scorer) for rows that carry one (reasoning-gym); with num_samples > 1 also
    pass@k, maj@k, soft_pass@k, soft_maj@k."""
    records: list[dict[str, Any]]
    """Per problem: index, question, prompt, reference, answer_format, fields (other dataset columns), and per
    sample: responses, answers (in the required format), soft_answers, statuses, strict, soft, format_ok,
    completion_lengths, truncated; plus num_strict_correct and num_soft_correct."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The decoding settings used (max_new_tokens, num_samples, temperature, top_p, seed, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line: "strict 41.7%  soft 55.0%  format 80.0%  (60 problems, greedy, 12.3 s)"."""
        m = self.metrics
        decoding = "greedy" if m["num_samples"] == 1 and self.settings.get("temperature", 0) == 0 else (
            f"{m['num_samples']} samples at T={self.settings.get('temperature')}")
        extra = "".join(f"  {key} {value:.1%}" for key, value in m.items()
                        if key.startswith(("pass@", "maj@")))
        return (
            f"strict {m['strict_accuracy']:.1%}  soft {m['soft_accuracy']:.1%}  format {m['format_rate']:.1%}"
            f"{extra}  ({m['n']} problems, {decoding}, {m['seconds']:.1f} s)"
        )


# --------------------------------------------------------------------------------------------------
# evaluate a loaded model
# --------------------------------------------------------------------------------------------------


def heldout_metrics(
    model,
    tokenizer,
    rows: Any,
    *,
    max_new_tokens: int = 256,
    max_prompt_length: int | None = None,
    **evaluate_kwargs: Any,
) -> dict[str, float]:
    """Greedy strict/soft accuracy and format rate of `rows`: the evaluator `forge train --eval_dataset` and
    the demo hand to GRPOTrainer(..., evaluator=heldout_metrics), logged as eval/<metric> during training.
    evaluate_kwargs go to `evaluate` (e.g. batch_size)."""
    return evaluate(
        model,
        tokenizer,
        rows,
        max_new_tokens=max_new_tokens,
        max_prompt_length=max_prompt_length,
        **evaluate_kwargs,
    ).metrics


def evaluate(
    model,
    tokenizer,
    rows: Any,
    *,
    max_new_tokens: int = 256,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    k_values: Sequence[int] = (1,),
    batch_size: int = 16,
    seed: int = 0,
    max_prompt_length: int | None = None,
    answer_format: str | None = None,
    merge_adapters: bool = True,
    generation_backend: str = "auto",
) -> EvalResult:
    """Generate for every row and grade the responses against ``row["reference"]``.

    rows: anything `forge.data.dataset.load_rows` accepts (a list of ``{"prompt", "reference", ...}`` dicts,
        a JSONL path, a built-in name). The prompt is a string or chat messages.
    num_samples, temperature: one greedy response per problem when num_samples == 1 and temperature == 0;
        otherwise num_samples samples at that temperature (several samples need temperature > 0).
    k_values: the k of pass@k and maj@k, each <= num_samples (reported when num_samples > 1).
    batch_size: prompts per generation call; the decode batch holds batch_size * num_samples sequences.
    max_prompt_length: longer prompts are an error (None: no limit beyond the model's context).
    answer_format: "tag" or "answer_line" for every row; None decides per row from its prompt
        (`detect_answer_format`).
    merge_adapters: a LoRA model generates with its adapters folded into a temporary copy of the weights
        (forge.model.merged_adapters: faster, the same outputs up to rounding; in bf16 the sum is formed in
        fp32 and rounded once, and the evaluation takes the base model's time; the model is left as it was).
    generation_backend: the decode step, 'eager', 'compiled' or 'auto' (GRPOConfig.generation_backend), or
        'vllm': an engine started from the model's (merged) weights for this evaluation
        (forge/model/vllm_engine.py), in the autocast dtype when autocast is on, else fp32; samples seeded
        from `seed`.
    """
    rows = load_rows(rows)
    _check_references(rows)
    _check_decoding(num_samples, temperature, k_values, batch_size, answer_format)
    warn_if_references_unreadable(rows)
    settings = _sampling_settings(max_new_tokens, temperature, top_p, generation_backend)
    formats = [answer_format or detect_answer_format(row["prompt"]) for row in rows]

    device = next(model.parameters()).device
    engine = None if generation_backend != "vllm" else colocated_engine(
        model, tokenizer, autocast_dtype(device.type), batch_size * num_samples, max_new_tokens, seed=seed)
    started = time.perf_counter()
    records = _generate_records(model, tokenizer, rows, formats, settings, engine, num_samples=num_samples,
                                batch_size=batch_size, max_prompt_length=max_prompt_length, seed=seed,
                                merge_adapters=merge_adapters)
    seconds = time.perf_counter() - started

    metrics = aggregate_metrics(records, num_samples, k_values)
    metrics["seconds"] = seconds
    decoding = {"max_new_tokens": max_new_tokens, "num_samples": num_samples, "temperature": temperature,
                "top_p": top_p, "k_values": list(k_values), "batch_size": batch_size, "seed": seed,
                "answer_format": answer_format, "max_prompt_length": max_prompt_length}
    return EvalResult(metrics=metrics, records=records, settings=decoding)


def _sampling_settings(max_new_tokens: int, temperature: float, top_p: float,
                       backend: str) -> SamplingSettings:
    """Greedy decoding at temperature 0 (argmax, the temperature left at 1.0), else sampling at
    `temperature`."""
    greedy = temperature == 0
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature if not greedy else 1.0,
                            top_p=top_p, top_k=0, do_sample=not greedy, backend=backend)


def _check_references(rows: Sequence[dict]) -> None:
    """A row with neither a reference answer nor a task scorer of its own is an error before any
    generation."""
    for index, row in enumerate(rows):
        if (row.get("reference") is None or not str(row["reference"]).strip()) and task_scorer(row) is None:
            raise ValueError(f"evaluation row {index} has no 'reference' answer; every row needs "
                             "{'prompt': ..., 'reference': '42'}")


def _generate_records(
    model,
    tokenizer,
    rows: list[dict],
    formats: list[str],
    settings: SamplingSettings,
    engine: Any,
    *,
    num_samples: int,
    batch_size: int,
    max_prompt_length: int | None,
    seed: int,
    merge_adapters: bool,
) -> list[dict]:
    """One graded record per row, generated `batch_size` prompts at a time in eval mode, without gradients,
    with the adapters merged when `merge_adapters`, from the global RNG seeded with `seed`; the RNG state and
    the model's train/eval mode are restored afterwards."""
    device = next(model.parameters()).device
    # the vLLM requests' seeds (the own loop: torch's global RNG)
    request_rng = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    records = []
    try:
        # fork_rng restores the global CPU (and this GPU's) RNG state afterwards
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), \
                merged_adapters(model, merge_adapters, rounded=True):
            torch.manual_seed(seed)
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                prompts = [row["prompt"] for row in chunk]
                rollout = _generate_chunk(model, tokenizer, prompts, num_samples, settings, max_prompt_length,
                                          engine, request_rng)
                records.extend(_chunk_records(start, chunk, formats, rollout, num_samples))
    finally:
        model.train(was_training)
    return records


def _generate_chunk(model, tokenizer, prompts: list, num_samples: int, settings: SamplingSettings,
                    max_prompt_length: int | None, engine: Any, request_rng: torch.Generator) -> Rollout:
    """`num_samples` completions of each prompt: Forge's own decode loop, or the vLLM `engine` when there is
    one, its requests seeded from `request_rng`."""
    if engine is None:
        return generate(model, tokenizer, prompts, num_samples, settings,
                        max_prompt_length=max_prompt_length or 10**9)
    noise = sampling_noise(request_rng, len(prompts) * num_samples, settings.max_new_tokens)
    return generate_on_engine(engine, tokenizer, prompts, num_samples, settings, max_prompt_length or 10**9,
                              noise=noise)


def _chunk_records(start: int, chunk: list[dict], formats: list[str], rollout: Rollout,
                   num_samples: int) -> list[dict]:
    """The graded records of a chunk of rows that starts at row `start`, each from its group of
    `num_samples` completions in `rollout`."""
    lengths, truncated = rollout.completion_lengths.tolist(), rollout.truncated.tolist()
    records = []
    for offset, row in enumerate(chunk):
        samples = slice(offset * num_samples, (offset + 1) * num_samples)  # this prompt's group
        records.append(_record(start + offset, row, formats[start + offset], rollout.completions[samples],
                               lengths[samples], truncated[samples]))
    return records


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype generation computes in here: autocast's when it is on, else fp32."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32


def unreadable_references(rows: Sequence[dict]) -> list[int]:
    """Indices of the rows whose reference the math grader cannot read as an answer (`readable_reference`: no
    number, no math); rows graded by their task's own scorer (reasoning-gym) are never among them."""
    return [index for index, row in enumerate(rows)
            if task_scorer(row) is None and not readable_reference(row.get("reference"))]


def graded_by_math(rows: Sequence[dict]) -> bool:
    """Whether the math grader can judge most of these rows (strict/soft accuracy mean something for them)."""
    return 2 * len(unreadable_references(rows)) <= len(rows)


def warn_if_references_unreadable(rows: Sequence[dict]) -> None:
    """Warn when the math grader cannot read most references: its accuracy would be a silent 0%."""
    unreadable = unreadable_references(rows)
    if 2 * len(unreadable) > len(rows):
        example = rows[unreadable[0]].get("reference")
        warnings.warn(
            f"{len(unreadable)} of {len(rows)} references are not numbers or math the grader reads (e.g. "
            f"row {unreadable[0]}: {str(example)!r:.60}), so strict/soft accuracy count every answer to them "
            f"as wrong. Score the responses with a reward that fits the data instead: `forge eval --reward "
            f"SPEC` (eval's reward), or GRPOTrainer's default evaluator (eval/reward)",
            stacklevel=3,
        )


def reward_metrics(
    model,
    tokenizer,
    rows: list[dict],
    rewards: Any,
    reward_weights: Sequence[float] | None = None,
    *,
    max_new_tokens: int = 256,
    max_prompt_length: int | None = None,
) -> dict[str, float]:
    """The mean reward of one greedy completion per row under `rewards` (anything GRPOTrainer's reward_fn
    takes, weighted by reward_weights): `forge.core.evaluator.greedy_reward_evaluator`, the trainer's default
    evaluator, with GRPOConfig's defaults for failing rewards. Returns reward, rewards/<name>, n."""
    config = GRPOConfig()
    evaluator = greedy_reward_evaluator(build_reward_list(rewards, reward_weights), config)
    return evaluator(model, tokenizer, rows, max_new_tokens=max_new_tokens,
                     max_prompt_length=max_prompt_length or 10**9)


def _check_decoding(num_samples, temperature, k_values, batch_size, answer_format) -> None:
    """Bad settings become clear errors before any generation."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if num_samples > 1 and temperature == 0:
        raise ValueError(f"num_samples={num_samples} with temperature=0 gives {num_samples} identical greedy "
                         "answers; set temperature > 0 (e.g. 0.7) to sample, or num_samples=1")
    too_large = [k for k in k_values if not 1 <= k <= num_samples]
    if too_large:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples={num_samples}; got k={too_large}. "
                         f"Raise num_samples or drop those k")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if answer_format is not None and answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS} or None (decide from each prompt); "
                         f"got {answer_format!r}")


def question_text(row: dict) -> str:
    """The problem as a person would read it: the row's "question", else the last user message, else the
    prompt."""
    if row.get("question"):
        return str(row["question"])
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    user_messages = [message["content"] for message in prompt if message.get("role") == "user"]
    return user_messages[-1] if user_messages else prompt[-1]["content"]


def _task_grade(g: Grade, scorer) -> tuple[Grade, float]:
    """Re-grade with a task's own scorer, as its training reward does: correct means score 1.0 (strict: the
    answer in the required format; soft: the final answer anywhere). Also returns the soft score."""
    strict_score, soft_score = scorer(g.answer), scorer(g.soft_answer)
    strict_correct, soft_correct = strict_score >= 1.0, soft_score >= 1.0
    status = NO_ANSWER if g.answer is None else CORRECT if strict_correct else WRONG_ANSWER
    return Grade(g.answer, g.soft_answer, strict_correct, soft_correct, g.format_ok, status), soft_score


def _record(index: int, row: dict, answer_format: str, responses: list[str], lengths: list[int],
            truncated: list[bool]) -> dict:
    """Grade one problem's responses (with the task's own scorer when the row carries one)."""
    grades = [grade(response, row["reference"], answer_format) for response in responses]
    scorer = task_scorer(row)  # a reasoning-gym row's own grader (its task's score_answer), else None
    task_scores = None
    if scorer is not None:
        graded = [_task_grade(g, scorer) for g in grades]
        grades, task_scores = [g for g, _ in graded], [score for _, score in graded]
    record = {
        "index": index,
        "question": question_text(row),
        "prompt": row["prompt"],
        "reference": str(row["reference"]),
        "answer_format": answer_format,
        "fields": {
            key: value for key, value in row.items() if key not in ("prompt", "reference", "question")
        },
        "responses": list(responses),
        "answers": [g.answer for g in grades],
        "soft_answers": [g.soft_answer for g in grades],
        "statuses": [g.status for g in grades],
        "strict": [g.strict_correct for g in grades],
        "soft": [g.soft_correct for g in grades],
        "format_ok": [g.format_ok for g in grades],
        "completion_lengths": [int(n) for n in lengths],
        "truncated": [bool(t) for t in truncated],
        "num_strict_correct": sum(g.strict_correct for g in grades),
        "num_soft_correct": sum(g.soft_correct for g in grades),
    }
    if task_scores is not None:
        # the task scorer's value of each soft answer (the default reward)
        record["task_scores"] = task_scores
    return record


def aggregate_metrics(records: Sequence[dict], num_samples: int, k_values: Sequence[int] = (1,)) -> dict:
    """Averages over every sample of every problem; pass@k and maj@k averaged over problems.

    maj@k takes the majority answer of the first k samples (samples are independent draws, so any k of them
    are a fair choice) and checks it against the reference.
    """
    samples = [(s, f, strict, soft, length, cut) for r in records for s, f, strict, soft, length, cut in zip(
        r["answers"], r["format_ok"], r["strict"], r["soft"], r["completion_lengths"], r["truncated"])]
    count = max(1, len(samples))
    metrics: dict[str, float] = {
        "strict_accuracy": sum(s[2] for s in samples) / count,
        "soft_accuracy": sum(s[3] for s in samples) / count,
        "format_rate": sum(s[1] for s in samples) / count,
        "mean_completion_length": sum(s[4] for s in samples) / count,
        "frac_truncated": sum(s[5] for s in samples) / count,
        "nonempty_rate": sum(bool(str(text).strip()) for r in records for text in r["responses"]) / count,
        "n": len(records),
        "num_samples": num_samples,
    }
    if records and all("task_scores" in r for r in records):  # rows graded by their task's own scorer
        metrics["task_score"] = _mean(score for r in records for score in r["task_scores"])
    if num_samples > 1 and records:
        for k in k_values:
            metrics[f"pass@{k}"] = _mean(pass_at_k(num_samples, r["num_strict_correct"], k) for r in records)
            metrics[f"maj@{k}"] = _mean(answers_match(majority_vote(r["answers"][:k]), r["reference"])
                                        for r in records)
            metrics[f"soft_pass@{k}"] = _mean(pass_at_k(num_samples, r["num_soft_correct"], k)
                                              for r in records)
            metrics[f"soft_maj@{k}"] = _mean(
                answers_match(majority_vote(r["soft_answers"][:k]), r["reference"]) for r in records
            )
    return metrics


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0


# --------------------------------------------------------------------------------------------------
# load a model and a data set by name, then evaluate
# --------------------------------------------------------------------------------------------------


def load_eval_rows(
    data: Any = "arithmetic",
    split: str = "test",
    n: int | None = None,
    chat: bool | None = None,
    *,
    prompt_column: str | None = None,
    reference_column: str | None = None,
) -> list[dict]:
    """Held-out rows by name: "arithmetic" (the fixed held-out arithmetic set, 60 problems unless n says
    otherwise), "gsm8k" (the hub split), "gsm-hard" (its only split; the name's split is ignored),
    "gsm8k-mock" (20 offline GSM8K-style problems), "reasoning-gym:NAME" (the task's held-out problems,
    50 unless n says otherwise, graded by the task's own scorer), "hf:ORG/NAME[:CONFIG][@SPLIT]" (``split``
    unless the name has one; ``prompt_column`` / ``reference_column`` name the columns); or a JSONL path, a
    list of rows, or any built-in name of `load_rows`. ``n`` keeps the first n problems.

    ``chat`` picks chat-message prompts (True) or plain text (False) for every named set; None keeps each
    set's own default: chat for "arithmetic" and reasoning-gym, the plain `format_prompt` for GSM8K and
    GSM-Hard, plain text for hf:. (`evaluate_model` passes the tokenizer's choice: chat with a chat template.)
    """
    task = task_for(str(data)) if isinstance(data, (str, Path)) else None
    if task is not None:
        rows = task.heldout(n=n, chat=chat, split=split)
    elif isinstance(data, str) and data.startswith("hf:"):
        rows = load_hf_rows(data, split=split, n=n, chat=bool(chat), prompt_column=prompt_column,
                            reference_column=reference_column)
    else:
        rows = load_rows(data)
    return rows if n is None else rows[:n]


def evaluate_model(
    model_name_or_path: Any = "default",
    adapter: str | Path | None = None,
    data: Any = "arithmetic",
    split: str = "test",
    n: int | None = None,
    *,
    chat: bool | None = None,
    prompt_column: str | None = None,
    reference_column: str | None = None,
    rewards: Any = None,
    reward_weights: Sequence[float] | None = None,
    **eval_kw: Any,
) -> EvalResult:
    """Load a model (hub id, local folder, .gguf, "default", or a loaded (model, tokenizer) pair) with an
    optional LoRA adapter, load held-out rows by name (`load_eval_rows`), and `evaluate` it. ``chat`` None:
    chat-message prompts when the tokenizer has a chat template (said on stderr for the sets whose prompts
    Forge writes; string prompts of other sources are warned about, `warn_if_raw_prompts`); True also wraps
    the string prompts of any source as one user message. ``rewards`` (weighted by ``reward_weights``) adds
    the mean reward of greedy completions under them (`reward_metrics`). ``eval_kw`` go to `evaluate`."""
    if eval_kw.get("generation_backend") == "vllm":
        require_vllm()  # before the model loads
    if isinstance(model_name_or_path, tuple):
        model, tokenizer = load_for_eval(model_name_or_path[0], adapter, tokenizer=model_name_or_path[1])
    else:
        model, tokenizer = load_for_eval(model_name_or_path, adapter)
    asked = chat
    chat = pick_chat(chat, tokenizer, data if isinstance(data, str) else None)
    rows = load_eval_rows(data, split=split, n=n, chat=chat, prompt_column=prompt_column,
                          reference_column=reference_column)
    rows = as_chat_rows(rows) if asked else rows
    if asked is None:
        warn_if_raw_prompts(rows, tokenizer)
    result = evaluate(model, tokenizer, rows, **eval_kw)
    if rewards is not None:
        result.metrics.update(reward_metrics(model, tokenizer, rows, rewards, reward_weights,
                                             max_new_tokens=eval_kw.get("max_new_tokens", 256),
                                             max_prompt_length=eval_kw.get("max_prompt_length")))
    return result
