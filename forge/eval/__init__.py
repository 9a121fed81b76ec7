"""Evaluation: strict/soft accuracy, format rate, pass@k and maj@k on held-out problems, before/after
reports, and screening of training prompts for mixed correctness."""

from forge.eval.evaluate import EvalResult, evaluate, evaluate_model, heldout_metrics, load_eval_rows
from forge.eval.metrics import Grade, detect_answer_format, grade, majority_vote, pass_at_k
from forge.eval.report import ComparisonReport, build_comparison, compare, compare_models, write_comparison
from forge.eval.screen import ScreenResult, screen_prompts

__all__ = [
    "ComparisonReport",
    "EvalResult",
    "Grade",
    "ScreenResult",
    "build_comparison",
    "compare",
    "compare_models",
    "detect_answer_format",
    "evaluate",
    "evaluate_model",
    "grade",
    "heldout_metrics",
    "load_eval_rows",
    "majority_vote",
    "pass_at_k",
    "screen_prompts",
    "write_comparison",
]
