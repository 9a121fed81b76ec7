"""Rewards from whatever the user passes: a function, a BaseReward, a built-in's name, an import path, a
reward model (a loaded sequence-classification model, its hub id or its folder), or a weighted list of them.

    build_reward_list(x, weights) a run's rewards as (unique name, reward, weight), each checked against the
                                  call its convention makes (`call_problem`; with the dataset's columns:
                                  `check_reward_columns`)
    as_reward(x)                  any one of them as a BaseReward (what GRPOTrainer and CompositeReward call)
    CompositeReward([(r, w), ..]) a weighted average of rewards
    SequenceClassificationReward  a HuggingFace reward model's logit as the score
    build_reward(name)            a built-in reward by name (REWARD_REGISTRY; `forge train --reward NAME`)
    load_reward_from_path(path)   ``module:attribute`` or ``file.py:attribute`` (`forge train --reward PATH`)

The reward protocol and the built-in rewards themselves are in core/reward.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from forge.core.reward import (
    BaseReward,
    ExactMatchReward,
    LengthPenaltyReward,
    MathCorrectnessReward,
    NumberReward,
    RewardOutput,
    TagFormatReward,
    TrainerState,
    call_with_accepted_kwargs,
)
from forge.core.scoring import (
    CONVENTIONS,
    FORGE_POSITIONS,
    Convention,
    FunctionReward,
    as_output,
    dataset_columns,
)
from forge.user_code import import_named_module


def build_reward_list(
    reward_fn: Any, weights: Sequence[float] | None = None, convention: str = "forge"
) -> list[tuple[str, BaseReward, float]]:
    """One reward, or a list of rewards (weighted by `weights`), as (unique name, reward, weight); plain
    functions are called by `convention` (forge.core.scoring.CONVENTIONS). A reward whose signature cannot
    take that call is an error here, before any model work."""
    is_list = isinstance(reward_fn, (list, tuple)) and not is_model_and_tokenizer(reward_fn)
    rewards = list(reward_fn) if is_list else [reward_fn]
    if not rewards:
        raise ValueError("reward_fn is empty; pass a reward (e.g. ExactMatchReward()) or a list of them")
    weights = list(weights) if weights is not None else [1.0] * len(rewards)
    if len(weights) != len(rewards):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(rewards)} reward functions")
    named, seen = [], {}
    for reward, weight in zip(rewards, weights):
        if is_model_and_tokenizer(reward):
            reward = SequenceClassificationReward(*reward)
        if not callable(reward) and not isinstance(reward, str):
            raise TypeError(f"reward {reward!r} is not callable; pass a BaseReward, f(prompts, completions), "
                            f"or a reward model (its hub id, folder, or (model, tokenizer))")
        wrapped = as_reward(reward, convention)
        name = getattr(wrapped, "name", None) or type(wrapped).__name__
        problem = call_problem(wrapped)
        if problem:
            raise TypeError(f"reward '{name}': {problem}")
        seen[name] = seen.get(name, 0) + 1
        named.append((name if seen[name] == 1 else f"{name}_{seen[name]}", wrapped, float(weight)))
    return named


def call_problem(reward: BaseReward, columns: Sequence[str] | None = None) -> str | None:
    """Why `reward` cannot take the call its convention makes, or None: checked when the trainer is built (the
    call's shape) and again when the dataset is known (`columns`: a required argument no column supplies)."""
    fn = reward.fn if isinstance(reward, FunctionReward) else reward
    convention = CONVENTIONS[reward.convention]
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    positional = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    takes_more = any(p.kind is kinds.VAR_POSITIONAL for p in parameters)
    if getattr(reward, "by_name", False):  # Forge's call, prompts and completions by name too
        convention = Convention(convention.supplies | set(FORGE_POSITIONS), convention.says)
        required = [p.name for p in parameters if p.default is kinds.empty
                    and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    elif reward.convention == "forge":
        if len(positional) < 2 and not takes_more:
            return (f"it takes {len(positional)} positional argument(s), but Forge calls {convention.says}; "
                    f"pass it as reward_funcs= to have it called as TRL calls rewards, every argument by "
                    f"keyword")
        required = [p.name for p in positional[2:] + [p for p in parameters if p.kind is kinds.KEYWORD_ONLY]
                    if p.default is kinds.empty]
    else:
        if any(p.kind is kinds.POSITIONAL_ONLY and p.default is kinds.empty for p in parameters):
            return (f"it has positional-only arguments, but Forge calls {convention.says}; pass it as "
                    f"reward_fn= to have it called Forge's way, prompts and completions by position")
        required = [p.name for p in parameters if p.default is kinds.empty
                    and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    supplied = set(convention.supplies) | set(columns or ())
    missing = [name for name in required if name not in supplied]
    if columns is None:
        missing = [name for name in missing if name in convention.supplies]  # the rest may be columns
    if missing:
        where = f"; the dataset's columns are {sorted(columns)}" if columns is not None else ""
        return f"it needs {missing}, which nothing supplies{where}; Forge calls {convention.says}"
    return None


def check_reward_columns(rewards: list[tuple[str, BaseReward, float]], rows: list[dict]) -> None:
    """A reward argument that neither its calling convention nor a dataset column supplies is an error before
    the first step, naming the columns there are."""
    columns = list(dataset_columns(rows[:1]))
    for name, reward, _ in rewards:
        problem = call_problem(reward, columns)
        if problem:
            raise ValueError(f"reward '{name}': {problem}")


def as_reward(fn_or_reward: Any, convention: str = "forge") -> BaseReward:
    """A BaseReward for a BaseReward (returned unchanged), a plain callable (wrapped in a `FunctionReward`
    that is called by `convention`: 'forge' or 'trl', see forge.core.scoring.CONVENTIONS), a
    sequence-classification model, or a string: a built-in reward's name, a ``module:function`` path, or else
    a reward model's hub id or folder. A BaseReward subclass passed by mistake instead of an
    instance is an error."""
    if isinstance(fn_or_reward, BaseReward):
        return fn_or_reward
    if isinstance(fn_or_reward, (str, os.PathLike)):
        text = str(fn_or_reward)
        if text in REWARD_REGISTRY:
            return build_reward(text)
        if ":" in text and not os.path.isdir(text):
            return load_reward_from_path(text, convention)
        return SequenceClassificationReward(text)
    if _is_sequence_classifier(fn_or_reward):
        return SequenceClassificationReward(fn_or_reward)
    if isinstance(fn_or_reward, type) and issubclass(fn_or_reward, BaseReward):
        raise TypeError(
            f"got the class {fn_or_reward.__name__}, not an instance; pass {fn_or_reward.__name__}(...)"
        )
    if callable(fn_or_reward):
        return FunctionReward(fn_or_reward, convention=convention)
    raise TypeError(
        f"a reward must be a BaseReward or a function f(prompts, completions, **kwargs) -> list[float]; "
        f"got {type(fn_or_reward).__name__}"
    )


def _is_sequence_classifier(obj: Any) -> bool:
    """A HF ``*ForSequenceClassification`` model (a torch module with a config and a classification head)."""
    return (
        hasattr(obj, "config")
        and callable(getattr(obj, "forward", None))
        and (
            type(obj).__name__.endswith("ForSequenceClassification")
            or any(
                a.endswith("ForSequenceClassification")
                for a in getattr(obj.config, "architectures", None) or []
            )
        )
    )


def is_model_and_tokenizer(obj: Any) -> bool:
    """``(model, tokenizer)``: a reward model given with its tokenizer, one reward (not a list of two)."""
    return (isinstance(obj, tuple) and len(obj) == 2 and _is_sequence_classifier(obj[0])
            and hasattr(obj[1], "pad_token_id") and not _is_sequence_classifier(obj[1]))


class SequenceClassificationReward(BaseReward):
    """A reward model: a HuggingFace sequence-classification model scores prompt + completion, and the score
    is its logit ``label_index`` (0: the usual single-output reward model, as TRL uses).

    ``model`` is a loaded ``*ForSequenceClassification`` model, a hub id or a local folder; ``tokenizer`` is
    read from the same place when not given. Scoring runs batched (``batch_size`` texts a forward), without
    gradients, on ``device``, or when that is None on the policy's device (from ``trainer_state``), else
    where the model is. A chat prompt (list of messages) is rendered with the tokenizer's chat template with
    the completion as the assistant's message; a plain prompt is prompt + completion.
    """

    def __init__(self, model: Any, tokenizer: Any = None, batch_size: int = 16, max_length: int | None = None,
                 label_index: int = 0, device: Any = None, name: str | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model, (str, os.PathLike)):
            source = str(model)
            model = AutoModelForSequenceClassification.from_pretrained(source)
            name = name or Path(source.rstrip("/")).name
        if not _is_sequence_classifier(model):
            raise TypeError(
                f"{type(model).__name__} is not a sequence-classification model; a reward model must be a "
                f"*ForSequenceClassification model (e.g. AutoModelForSequenceClassification), its hub id "
                f"or its folder"
            )
        if tokenizer is None:
            source = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
            if not source:
                raise ValueError("this reward model has no name or path to load its tokenizer from; pass it: "
                                 "SequenceClassificationReward(model, tokenizer)")
            tokenizer = AutoTokenizer.from_pretrained(source)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        num_labels = getattr(model.config, "num_labels", 1)
        if not 0 <= label_index < num_labels:
            raise ValueError(f"label_index={label_index} is outside the model's {num_labels} outputs")
        if tokenizer.pad_token_id is None:  # batches need padding; the classifier finds the last real token
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        model.eval()
        model.requires_grad_(False)
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self.label_index, self.device = label_index, device
        if name:
            self.name = name

    def text(self, prompt: Any, response: str) -> tuple[str, bool]:
        """The text scored for one sample, and whether the tokenizer should add its special tokens."""
        if isinstance(prompt, str):
            return prompt + response, True
        messages = [*prompt, {"role": "assistant", "content": response}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False), False
        return "\n".join(str(m.get("content", "")) for m in messages), True

    def __call__(self, prompts: list, responses: list[str], trainer_state: TrainerState | None = None,
                 **kwargs: Any) -> RewardOutput:
        import torch

        device = self.device or getattr(trainer_state, "device", None)
        if device is not None and next(self.model.parameters()).device != torch.device(device):
            self.model.to(device)
        device = next(self.model.parameters()).device
        texts = [self.text(p, r) for p, r in zip(prompts, responses)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start:start + self.batch_size]
                special = chunk[0][1]
                encoded = self.tokenizer([t for t, _ in chunk], padding=True, padding_side="right",
                                         truncation=self.max_length is not None, max_length=self.max_length,
                                         add_special_tokens=special, return_tensors="pt").to(device)
                logits = self.model(input_ids=encoded["input_ids"],
                                    attention_mask=encoded["attention_mask"]).logits
                scores.extend(logits[:, self.label_index].float().cpu().tolist())  # (b,)
        return RewardOutput(scores=scores)


class CompositeReward(BaseReward):
    """A weighted average of rewards: ``sum_i w_i * r_i / sum_i w_i``.

    ``components`` is a sequence of ``(reward, weight)``; a reward may be a BaseReward or a plain
    function (see `as_reward`). Weights must be non-negative with a positive sum; they are
    normalised to sum to 1. Each component receives only the keyword arguments its signature
    accepts. The output metadata holds ``components`` (name -> that component's scores),
    ``weights`` (name -> normalised weight) and, for components that returned metadata,
    ``component_metadata`` (name -> their metadata). Names repeated across components get a
    ``_2``, ``_3``, ... suffix so that each can be logged separately.
    """

    def __init__(self, components: Sequence[tuple[BaseReward | Callable[..., Any], float]]) -> None:
        if not components:
            raise ValueError("CompositeReward needs at least one (reward, weight) pair")
        rewards, weights = [], []
        for index, component in enumerate(components):
            if not (isinstance(component, tuple | list) and len(component) == 2):
                raise TypeError(
                    f"CompositeReward component {index} must be a (reward, weight) pair, got {component!r}"
                )
            reward, weight = component
            weight = float(weight)
            if not weight >= 0.0 or weight == float("inf"):
                raise ValueError(
                    f"CompositeReward weight {index} is {weight}; weights must be finite and >= 0 "
                    "(to penalise something, use a reward that returns negative scores)"
                )
            rewards.append(as_reward(reward))
            weights.append(weight)
        total = sum(weights)
        if total <= 0.0:
            raise ValueError("CompositeReward weights sum to 0; give at least one reward a positive weight")
        self.rewards = rewards
        self.weights = [weight / total for weight in weights]
        self.component_names = _unique_names([reward.name for reward in rewards])

    def __call__(self, prompts: list[str], responses: list[str], **kwargs: Any) -> RewardOutput:
        totals = [0.0] * len(responses)
        components: dict[str, list[float]] = {}
        component_metadata: dict[str, dict[str, Any]] = {}
        for name, reward, weight in zip(self.component_names, self.rewards, self.weights):
            output = as_output(call_with_accepted_kwargs(reward, prompts, responses, kwargs))
            scores = list(output.scores)
            if len(scores) != len(responses):
                raise ValueError(
                    f"reward '{name}' returned {len(scores)} scores for {len(responses)} responses; "
                    "a reward must return exactly one score per response"
                )
            components[name] = scores
            if output.metadata:
                component_metadata[name] = output.metadata
            for index, score in enumerate(scores):
                totals[index] += weight * float(score)
        metadata: dict[str, Any] = {
            "components": components,
            "weights": dict(zip(self.component_names, self.weights)),
        }
        if component_metadata:
            metadata["component_metadata"] = component_metadata
        return RewardOutput(scores=totals, metadata=metadata)


def _unique_names(names: Sequence[str]) -> list[str]:
    """``["a", "b", "a"]`` -> ``["a", "b", "a_2"]``."""
    seen: dict[str, int] = {}
    unique = []
    taken = set(names)
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        candidate = name
        if seen[name] > 1:
            suffix = seen[name]
            while f"{name}_{suffix}" in taken:
                suffix += 1
            candidate = f"{name}_{suffix}"
        taken.add(candidate)
        unique.append(candidate)
    return unique


# ----------------------------------------------------------------------------------------------
# Building rewards from names and import paths (for the CLI's --reward option)

REWARD_REGISTRY: dict[str, Callable[..., BaseReward]] = {
    "exact_match": ExactMatchReward,
    "math_correctness": MathCorrectnessReward,
    "tag_format": TagFormatReward,
    "number": NumberReward,
    "length": LengthPenaltyReward,
}
"""Built-in rewards by name. Each constructor works with no arguments."""


def build_reward(name: str, **kwargs: Any) -> BaseReward:
    """A built-in reward by registry name, e.g. ``build_reward("math_correctness", strict=True)``."""
    if name not in REWARD_REGISTRY:
        raise ValueError(
            f"unknown reward '{name}'; built-in rewards are: {', '.join(sorted(REWARD_REGISTRY))}"
        )
    return REWARD_REGISTRY[name](**kwargs)


def load_reward_from_path(path: str, convention: str = "forge") -> BaseReward:
    """Import a reward given as ``"module:attribute"``, ``"package.module.attribute"`` or
    ``"path/to/file.py:attribute"``.

    The attribute may be a function (wrapped with `as_reward`), a BaseReward instance, or a reward
    class (instantiated with no arguments). A module is looked up in the current folder first
    (forge/user_code.py), then on PYTHONPATH. Import errors propagate.
    """
    module_name, separator, attribute = path.rpartition(":")
    if not separator:
        module_name, separator, attribute = path.rpartition(".")
    if not separator or not module_name or not attribute:
        raise ValueError(f"reward path must look like 'module:function' or 'file.py:function', got '{path}'")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        file_path = Path(module_name)
        if not file_path.is_file():
            raise FileNotFoundError(f"reward file '{file_path}' does not exist")
        spec = importlib.util.spec_from_file_location(f"forge_user_reward_{file_path.stem}", file_path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import rewards from '{file_path}'")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = import_named_module(module_name)  # the current folder first (forge/user_code.py)
    if not hasattr(module, attribute):
        raise AttributeError(
            f"module '{module_name}' has no attribute '{attribute}' (from reward path '{path}')"
        )
    target = getattr(module, attribute)
    # a reward class (BaseReward or a plain callable class): its default instance
    if isinstance(target, type):
        try:
            target = target()
        except Exception as error:  # noqa: BLE001 - the user's __init__: said in one line, with its own words
            detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            raise ValueError(
                f"reward {path!r}: {attribute}() raised {type(error).__name__}: {detail}; a reward "
                f"class given by name is built with no arguments: give its arguments defaults, or pass "
                f"an instance from Python"
            ) from None
    return as_reward(target, convention)


__all__ = ["REWARD_REGISTRY", "CompositeReward", "SequenceClassificationReward", "as_reward", "build_reward",
           "build_reward_list", "call_problem", "check_reward_columns", "is_model_and_tokenizer",
           "load_reward_from_path"]
