"""Before/after reports: evaluate two models with the same decoding and show, problem by
problem, what changed.

`compare` evaluates both models on the same rows; `build_comparison` pairs two existing `EvalResult`s;
`write_comparison` writes the pairing as JSON (everything) and Markdown (for reading): the summary table
first, then the problems the second model fixed, those it broke, those whose text changed without changing
the verdict, and last those where both wrote the same text. A problem counts as fixed (broken) when the
second model has more (fewer) strictly correct samples than the first; with greedy decoding that is simply
wrong -> right (right -> wrong).

Each response also carries the training reward components it would have earned (`MathCorrectnessReward`,
and `TagFormatReward` for prompts that ask for tags), so a report shows what the policy was paid for.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from forge.core.reward import MathCorrectnessReward, TagFormatReward
from forge.data.dataset import load_rows
from forge.eval.evaluate import EvalResult, evaluate, load_eval_rows
from forge.model import load_for_eval

CHANGE_ORDER = ("fixed", "broken", "changed", "identical")
"""Problem categories in the order the Markdown report lists them."""

_SUMMARY_METRICS = {  # key -> row label; pass@k / maj@k rows are added when both results have them
    "strict_accuracy": "strict accuracy",
    "soft_accuracy": "soft accuracy",
    "format_rate": "format rate",
}
_TRAILING_METRICS = {"mean_completion_length": "mean length (tokens)", "frac_truncated": "truncated"}
_SAMPLE_FIELDS = ("responses", "answers", "soft_answers", "statuses", "strict", "soft", "format_ok",
                  "completion_lengths", "truncated")


@dataclass
class ComparisonReport:
    """Two evaluations of the same problems, side by side."""

    labels: tuple[str, str]  # names of the two models in the report, e.g. ("base", "trained")
    summary: list[dict[str, Any]]  # one row per metric: {"metric", "label", "before", "after", "change"}
    counts: dict[str, int]  # problems per category of CHANGE_ORDER
    problems: list[dict[str, Any]]  # per problem, in CHANGE_ORDER; each holds a "before" and an "after" side
    metrics: dict[str, dict[str, float]]  # {"before": all metrics, "after": all metrics}
    settings: dict[str, Any] = field(default_factory=dict)  # decoding settings (the same for both)
    notes: str = ""  # free text shown under the title, e.g. which checkpoints were compared

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary_markdown(self) -> str:
        """The summary table and the per-problem counts, as Markdown."""
        before, after = self.labels
        lines = [f"| metric | {before} | {after} | change |", "|---|---:|---:|---:|"]
        for row in self.summary:
            lines.append(
                f"| {row['label']} | {_format(row['metric'], row['before'])} | "
                f"{_format(row['metric'], row['after'])} | {_format_change(row['metric'], row['change'])} |"
            )
        c = self.counts
        counts = (
            f"Per problem (strict): {c['fixed']} fixed, {c['broken']} broken, {c['changed']} with new text "
            f"but the same verdict, {c['identical']} identical."
        )
        lines += ["", counts]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# building a comparison
# --------------------------------------------------------------------------------------------------


def build_comparison(before: EvalResult, after: EvalResult, labels: tuple[str, str] = ("before", "after"),
                     notes: str = "") -> ComparisonReport:
    """Pair two evaluations of the same problems (same order) into a `ComparisonReport`."""
    if len(before.records) != len(after.records):
        raise ValueError(
            f"the two evaluations cover {len(before.records)} and {len(after.records)} problems; "
            "evaluate both models on the same rows"
        )
    for b, a in zip(before.records, after.records):
        if (b["question"], b["reference"]) != (a["question"], a["reference"]):
            raise ValueError(
                f"problem {b['index']} differs between the two evaluations ({b['question'][:60]!r} vs "
                f"{a['question'][:60]!r}); evaluate both models on the same rows in the same order"
            )
    if labels[0] == labels[1]:
        raise ValueError(f"the two labels must differ, got {labels}")

    problems = [_pair(b, a) for b, a in zip(before.records, after.records)]
    problems.sort(key=lambda problem: CHANGE_ORDER.index(problem["change"]))  # stable: index order within
    counts = {change: sum(p["change"] == change for p in problems) for change in CHANGE_ORDER}
    return ComparisonReport(labels=tuple(labels), summary=_summary_rows(before.metrics, after.metrics),
                            counts=counts, problems=problems,
                            metrics={"before": dict(before.metrics), "after": dict(after.metrics)},
                            settings=dict(after.settings), notes=notes)


def _pair(before: dict, after: dict) -> dict:
    if after["num_strict_correct"] > before["num_strict_correct"]:
        change = "fixed"
    elif after["num_strict_correct"] < before["num_strict_correct"]:
        change = "broken"
    elif after["responses"] != before["responses"]:
        change = "changed"
    else:
        change = "identical"
    return {
        "index": before["index"],
        "question": before["question"],
        "reference": before["reference"],
        "answer_format": before["answer_format"],
        "fields": before["fields"],
        "change": change,
        "same_text": before["responses"] == after["responses"],
        "before": _side(before),
        "after": _side(after),
    }


def _side(record: dict) -> dict:
    """One model's samples for one problem, with the reward components each response would have earned."""
    side = {key: record[key] for key in _SAMPLE_FIELDS}
    side["rewards"] = reward_components(record["responses"], record["reference"], record["answer_format"])
    return side


def reward_components(responses: list[str], reference: str, answer_format: str) -> list[dict[str, float]]:
    """The built-in training rewards for each response: math_correctness, and tag_format for tag prompts."""
    prompts = [""] * len(responses)
    correctness = MathCorrectnessReward()(prompts, responses, references=[reference] * len(responses)).scores
    components = [{"math_correctness": float(score)} for score in correctness]
    if answer_format == "tag":
        tag_format = TagFormatReward()
        for component, response in zip(components, responses):
            component["tag_format"] = tag_format.score(response)
    return components


def _summary_rows(before: dict, after: dict) -> list[dict]:
    keys = dict(_SUMMARY_METRICS)
    for key in before:
        if key.startswith(("pass@", "maj@", "soft_pass@", "soft_maj@")) and key in after:
            keys[key] = key
    keys.update(_TRAILING_METRICS)
    return [
        {
            "metric": key,
            "label": label,
            "before": before[key],
            "after": after[key],
            "change": after[key] - before[key],
        }
        for key, label in keys.items()
        if key in before and key in after
    ]


def _format(metric: str, value: float) -> str:
    return f"{value:.1f}" if metric == "mean_completion_length" else f"{value:.1%}"


def _format_change(metric: str, change: float) -> str:
    return f"{change:+.1f}" if metric == "mean_completion_length" else f"{100 * change:+.1f} pts"


# --------------------------------------------------------------------------------------------------
# evaluating two models
# --------------------------------------------------------------------------------------------------


def compare(before_model, after_model, tokenizer, rows: Any, *, labels: tuple[str, str] = ("before", "after"),
            notes: str = "", **eval_kw: Any) -> ComparisonReport:
    """Evaluate both models on the same rows with the same decoding (`eval_kw` go to `evaluate`)."""
    rows = load_rows(rows)
    before = evaluate(before_model, tokenizer, rows, **eval_kw)
    after = evaluate(after_model, tokenizer, rows, **eval_kw)
    return build_comparison(before, after, labels=labels, notes=notes)


def compare_models(
    before: str | Path,
    after: str | Path,
    *,
    out_dir: str | Path | None = None,
    adapter: str | Path | None = None,
    before_adapter: str | Path | None = None,
    data: Any = "arithmetic",
    split: str = "test",
    n: int | None = None,
    labels: tuple[str, str] = ("before", "after"),
    **eval_kw: Any,
) -> tuple[Path, Path, str]:
    """Load and evaluate two models one after the other (only one is in memory at a time), then write the
    report to `out_dir` (default ./forge_comparison). ``adapter`` is a LoRA adapter applied to ``after``,
    ``before_adapter`` one applied to ``before``. Returns (json path, markdown path, summary table text)."""
    results = []
    for name, lora in ((before, before_adapter), (after, adapter)):
        model, tokenizer = load_for_eval(name, lora)
        rows = load_eval_rows(data, split=split, n=n, chat=bool(getattr(tokenizer, "chat_template", None)))
        results.append(evaluate(model, tokenizer, rows, **eval_kw))
        del model
        gc.collect()
    def describe(name, lora) -> str:
        return f"`{name}`" + (f" + adapter `{lora}`" if lora else "")

    notes = (f"{labels[0]}: {describe(before, before_adapter)}; {labels[1]}: {describe(after, adapter)}; "
             f"data: {data}" + (f" (first {n})" if n else ""))
    report = build_comparison(results[0], results[1], labels=labels, notes=notes)
    json_path, md_path = write_comparison(report, out_dir or "forge_comparison")
    return json_path, md_path, report.summary_markdown()


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------


def write_comparison(report: ComparisonReport, out_dir: str | Path) -> tuple[Path, Path]:
    """Write comparison.json and comparison.md into `out_dir` (created if missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "comparison.json", out_dir / "comparison.md"
    json_path.write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md_path.write_text(comparison_markdown(report), encoding="utf-8")
    return json_path, md_path


def comparison_markdown(report: ComparisonReport) -> str:
    before_label, after_label = report.labels
    lines = [f"# {before_label} vs {after_label}", ""]
    if report.notes:
        lines += [report.notes, ""]
    lines += [_decoding_line(report.settings, len(report.problems)), "", "## Summary", "",
              report.summary_markdown()]
    headings = {"fixed": f"Fixed: wrong for {before_label}, right for {after_label}",
                "broken": f"Broken: right for {before_label}, wrong for {after_label}",
                "changed": "New text, same verdict",
                "identical": "Identical text"}
    for change in CHANGE_ORDER:
        problems = [p for p in report.problems if p["change"] == change]
        if not problems:
            continue
        lines += ["", f"## {headings[change]} ({len(problems)})"]
        for problem in problems:
            lines += ["", *_problem_markdown(problem, report.labels)]
    return "\n".join(lines) + "\n"


def _decoding_line(settings: dict, count: int) -> str:
    samples, temperature = settings.get("num_samples", 1), settings.get("temperature", 0.0)
    decoding = ("greedy" if samples == 1 and temperature == 0
                else f"{samples} samples at temperature {temperature}")
    return (f"{count} problems, {decoding}, max_new_tokens {settings.get('max_new_tokens')}, "
            f"seed {settings.get('seed')}.")


def _problem_markdown(problem: dict, labels: tuple[str, str]) -> list[str]:
    lines = [f"### Problem {problem['index']} (reference: {problem['reference']})", ""]
    lines += ["> " + line for line in problem["question"].splitlines() or [""]]
    if problem["same_text"]:
        lines += ["", "*Both models wrote the same text.*"]
        lines += _side_markdown(problem["before"], f"{labels[0]} and {labels[1]}")
    else:
        lines += _side_markdown(problem["before"], labels[0]) + _side_markdown(problem["after"], labels[1])
    return lines


def _side_markdown(side: dict, label: str) -> list[str]:
    lines = []
    count = len(side["responses"])
    for i in range(count):
        rewards = ", ".join(f"{name} {value:g}" for name, value in side["rewards"][i].items())
        name = label if count == 1 else f"{label}, sample {i + 1}/{count}"
        verdict = (f"**{name}**: {side['statuses'][i]} | answer {_code(side['answers'][i])} | "
                   f"soft {'right' if side['soft'][i] else 'wrong'} ({_code(side['soft_answers'][i])}) | "
                   f"{side['completion_lengths'][i]} tokens{', truncated' if side['truncated'][i] else ''} | "
                   f"rewards: {rewards}")
        lines += ["", verdict, "", *_fenced(side["responses"][i])]
    return lines


def _code(value: str | None) -> str:
    if value is None:
        return "none"
    value = value.replace("\n", " ")
    return f"`` {value} ``" if "`" in value else f"`{value}`"


def _fenced(text: str) -> list[str]:
    """A code block that the text cannot close early, whatever backticks it holds."""
    longest, run = 0, 0
    for char in text:
        run = run + 1 if char == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [fence + "text", text, fence]
