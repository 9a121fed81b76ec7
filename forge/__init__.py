"""Forge: GRPO fine-tuning for HuggingFace causal language models.

    from forge import GRPOTrainer, GRPOConfig, ExactMatchReward
    GRPOTrainer(model, tokenizer, reward_fn=ExactMatchReward(), config=GRPOConfig()).train(dataset)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Names are imported on first use, so `forge --help` and `import forge.core.grpo` do not load transformers.
_WHERE = {
    "AsyncGRPOConfig": "forge.core.async_grpo",
    "AsyncGRPOTrainer": "forge.core.async_grpo",
    "GRPOConfig": "forge.core.config",
    "apply_lora": "forge.model",
    "load_model": "forge.model",
    "merge_and_export": "forge.model",
    "BaseReward": "forge.core.reward",
    "CompositeReward": "forge.core.reward_sources",
    "ExactMatchReward": "forge.core.reward",
    "FormatReward": "forge.core.reward",
    "LengthPenaltyReward": "forge.core.reward",
    "MathCorrectnessReward": "forge.core.reward",
    "NumberReward": "forge.core.reward",
    "RewardOutput": "forge.core.reward",
    "TagFormatReward": "forge.core.reward",
    "GRPOTrainer": "forge.core.trainer",
    "TrainingInterrupted": "forge.core.trainer",
    "extract_answer": "forge.data.gsm8k",
    "format_prompt": "forge.data.gsm8k",
    "load_gsm8k": "forge.data.gsm8k",
    "load_gsm8k_mock": "forge.data.gsm8k",
    "load_gsm_hard": "forge.data.gsm8k",
    "ForgeLogger": "forge.logging.logger",
}

if TYPE_CHECKING:
    from forge.core.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from forge.core.config import GRPOConfig
    from forge.core.reward import (
        BaseReward,
        ExactMatchReward,
        FormatReward,
        LengthPenaltyReward,
        MathCorrectnessReward,
        NumberReward,
        RewardOutput,
        TagFormatReward,
    )
    from forge.core.reward_sources import CompositeReward
    from forge.core.trainer import GRPOTrainer, TrainingInterrupted
    from forge.data.gsm8k import extract_answer, format_prompt, load_gsm8k, load_gsm8k_mock, load_gsm_hard
    from forge.logging.logger import ForgeLogger
    from forge.model import apply_lora, load_model, merge_and_export


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'forge' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__version__ = "0.2.0"


def evaluate(*args, **kwargs):
    """Evaluate a model on held-out problems; see forge.eval.evaluate.evaluate."""
    from forge.eval.evaluate import evaluate as _evaluate

    return _evaluate(*args, **kwargs)


__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
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
