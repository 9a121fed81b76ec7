"""Forge: GRPO fine-tuning for HuggingFace causal language models.

    from forge import GRPOTrainer, GRPOConfig, ExactMatchReward
    GRPOTrainer(model, tokenizer, reward_fn=ExactMatchReward(), config=GRPOConfig()).train(dataset)
"""

from forge.core.grpo import GRPOConfig
from forge.core.policy import apply_lora, load_model, merge_and_export
from forge.core.reward import (
    BaseReward,
    CompositeReward,
    ExactMatchReward,
    FormatReward,
    LengthPenaltyReward,
    MathCorrectnessReward,
    NumberReward,
    RewardOutput,
    TagFormatReward,
)
from forge.core.trainer import GRPOTrainer, TrainingInterrupted
from forge.data.gsm8k import extract_answer, format_prompt, load_gsm8k, load_gsm8k_mock, load_gsm_hard
from forge.logging.logger import ForgeLogger

__version__ = "0.2.0"


def evaluate(*args, **kwargs):
    """Evaluate a model on held-out problems; see forge.eval.evaluate.evaluate."""
    from forge.eval.evaluate import evaluate as _evaluate

    return _evaluate(*args, **kwargs)


__all__ = [
    "BaseReward",
    "CompositeReward",
    "ExactMatchReward",
    "ForgeLogger",
    "FormatReward",
    "GRPOConfig",
    "GRPOTrainer",
    "LengthPenaltyReward",
    "MathCorrectnessReward",
    "NumberReward",
    "RewardOutput",
    "TagFormatReward",
    "TrainingInterrupted",
    "apply_lora",
    "evaluate",
    "extract_answer",
    "format_prompt",
    "load_gsm8k",
    "load_gsm8k_mock",
    "load_gsm_hard",
    "load_model",
    "merge_and_export",
]
