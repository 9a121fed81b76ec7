"""Screen candidate training prompts: keep those the model sometimes gets right and sometimes wrong.

GRPO learns only from groups whose rewards differ: when all G completions of a prompt are right, or all
wrong, every advantage in the group is zero and the prompt costs a full rollout for no gradient. Sampling G
completions per candidate once before training and keeping the mixed groups (the filter DAPO applies online
as "dynamic sampling", Yu et al. 2025, https://arxiv.org/abs/2503.14476, section 3.2) spends the training
budget on prompts at the edge of what the model can do.

A sample counts as correct by the evaluation grader (`forge.eval.metrics.grade`): "soft" (the final answer
anywhere, what `MathCorrectnessReward()` pays) or "strict" (the answer in the format the prompt asks for,
what `MathCorrectnessReward(strict=True)` pays on tag prompts).

Never screen held-out rows. Choosing training prompts by how the model does on them is fine; choosing them
from the evaluation set would leak it into training. Pass the held-out rows as ``heldout_rows`` and
`screen_prompts` refuses candidates that share a prompt or a question with them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from forge.core.rollout import SamplingSettings, generate
from forge.data.dataset import load_rows
from forge.eval.evaluate import question_text
from forge.eval.metrics import detect_answer_format, grade

KEEP_RULES: dict[str, Callable[[int, int], bool]] = {
    "mixed": lambda correct, group_size: 0 < correct < group_size,  # some right, some wrong
    "unsolved": lambda correct, group_size: correct < group_size,  # not always right (all-wrong included)
    "all": lambda correct, group_size: True,  # keep everything, just count
}
"""Which candidates to keep, given the number of correct samples out of group_size."""


@dataclass
class ScreenResult:
    """The kept rows and how every candidate fared."""

    kept: list[dict]  # the kept rows, unchanged and in their original order
    correct_counts: list[int]  # (num_candidates,) correct samples per candidate, out of group_size
    group_size: int
    keep: str
    correct_by: str
    seconds: float = 0.0
    # per candidate: index, question, reference, correct, kept
    candidates: list[dict] = field(default_factory=list)

    @property
    def num_candidates(self) -> int:
        return len(self.correct_counts)

    @property
    def num_kept(self) -> int:
        return len(self.kept)

    @property
    def num_all_correct(self) -> int:
        return sum(count == self.group_size for count in self.correct_counts)

    @property
    def num_all_wrong(self) -> int:
        return sum(count == 0 for count in self.correct_counts)

    @property
    def num_mixed(self) -> int:
        return self.num_candidates - self.num_all_correct - self.num_all_wrong

    def summary(self) -> str:
        return (
            f"screened {self.num_candidates} prompts x {self.group_size} samples ({self.correct_by} grading, "
            f"{self.seconds:.0f} s): kept {self.num_kept} ({self.keep}); {self.num_mixed} mixed, "
            f"{self.num_all_correct} all correct, {self.num_all_wrong} all wrong"
        )

    def report(self) -> dict[str, Any]:
        """Everything except the kept rows themselves, JSON-ready."""
        return {"num_candidates": self.num_candidates, "num_kept": self.num_kept, "num_mixed": self.num_mixed,
                "num_all_correct": self.num_all_correct, "num_all_wrong": self.num_all_wrong,
                "group_size": self.group_size, "keep": self.keep, "correct_by": self.correct_by,
                "seconds": self.seconds, "correct_counts": self.correct_counts, "candidates": self.candidates}


def screen_prompts(
    model,
    tokenizer,
    rows: Any,
    *,
    group_size: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 4,
    keep: str = "mixed",
    correct_by: str = "soft",
    heldout_rows: Sequence[dict] | None = None,
    max_prompt_length: int | None = None,
    generate_fn: Callable[..., Any] | None = None,
) -> ScreenResult:
    """Sample `group_size` completions for each candidate row and keep the rows that pass the `keep` rule.

    rows: training candidates with "prompt" and "reference" (anything `load_rows` accepts). Never held-out
        rows; pass those as `heldout_rows` to have any overlap (same prompt or same question) refused.
    keep: "mixed" (at least one right and one wrong), "unsolved" (not all right) or "all".
    correct_by: "soft" or "strict" grading (see the module docstring).
    batch_size: prompts per generation call (batch_size * group_size sequences decode together).
    generate_fn: stands in for `forge.core.rollout.generate` (same arguments, returns an object with
        ``.completions`` laid out prompt by prompt); for tests.
    """
    rows = load_rows(rows)
    _check_screen_arguments(rows, keep, correct_by, group_size, temperature, heldout_rows)
    settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=0,
                                do_sample=True)
    started = time.perf_counter()
    correct_counts = count_correct(model, tokenizer, rows, group_size, settings, seed=seed,
                                   batch_size=batch_size, correct_by=correct_by,
                                   max_prompt_length=max_prompt_length, generate_fn=generate_fn or generate)
    rule = KEEP_RULES[keep]
    kept_flags = [rule(count, group_size) for count in correct_counts]
    candidates = [{"index": index, "question": question_text(row), "reference": str(row["reference"]),
                   "correct": count, "kept": flag}
                  for index, (row, count, flag) in enumerate(zip(rows, correct_counts, kept_flags))]
    return ScreenResult(
        kept=[row for row, flag in zip(rows, kept_flags) if flag],
        correct_counts=correct_counts,
        group_size=group_size,
        keep=keep,
        correct_by=correct_by,
        seconds=time.perf_counter() - started,
        candidates=candidates,
    )


def _check_screen_arguments(rows: list[dict], keep: str, correct_by: str, group_size: int, temperature: float,
                            heldout_rows: Sequence[dict] | None) -> None:
    """screen_prompts' arguments that cannot screen, refused before any sampling."""
    if keep not in KEEP_RULES:
        raise ValueError(f"keep must be one of {sorted(KEEP_RULES)}, got {keep!r}")
    if correct_by not in ("soft", "strict"):
        raise ValueError(f"correct_by must be 'soft' or 'strict', got {correct_by!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to tell mixed groups apart, got {group_size}")
    if temperature <= 0:
        raise ValueError(f"screening samples, so temperature must be > 0 (got {temperature}); "
                         "greedy decoding would give identical samples")
    for index, row in enumerate(rows):
        if row.get("reference") is None or not str(row["reference"]).strip():
            raise ValueError(f"candidate row {index} has no 'reference' answer to grade against")
    if heldout_rows is not None:
        check_disjoint(rows, heldout_rows)


def count_correct(model, tokenizer, rows: list[dict], group_size: int, settings: SamplingSettings, *,
                  seed: int, batch_size: int, correct_by: str, max_prompt_length: int | None,
                  generate_fn: Callable[..., Any]) -> list[int]:
    """How many of each row's `group_size` samples are right (graded `correct_by`), sampled in eval mode
    under a seed that leaves the global random state as it was."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct_counts: list[int] = []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                rollout = generate_fn(
                    model,
                    tokenizer,
                    [row["prompt"] for row in chunk],
                    group_size,
                    settings,
                    max_prompt_length=max_prompt_length or 10**9,
                )
                for offset, row in enumerate(chunk):
                    group = rollout.completions[offset * group_size:(offset + 1) * group_size]
                    answer_format = detect_answer_format(row["prompt"])
                    grades = [grade(completion, row["reference"], answer_format) for completion in group]
                    correct_counts.append(sum(g.soft_correct if correct_by == "soft" else g.strict_correct
                                              for g in grades))
    finally:
        model.train(was_training)
    return correct_counts


def check_disjoint(candidate_rows: Sequence[dict], heldout_rows: Sequence[dict]) -> None:
    """Raise ValueError when a candidate shares its prompt or its question with a held-out row."""
    heldout = ({_prompt_key(row["prompt"]) for row in heldout_rows}
               | {question_text(row) for row in heldout_rows})
    overlap = [index for index, row in enumerate(candidate_rows)
               if _prompt_key(row["prompt"]) in heldout or question_text(row) in heldout]
    if overlap:
        first = question_text(candidate_rows[overlap[0]])
        raise ValueError(
            f"{len(overlap)} candidate prompts are also in the held-out set (first: row {overlap[0]}, "
            f"{first[:80]!r}); screen training rows only, e.g. arithmetic_dataset(), never "
            "arithmetic_heldout()"
        )


def _prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
