"""A helper of the loss tests: the variant as keywords, as the hand-derived cases write it."""

from forge.core.grpo import LossSettings, grpo_loss


def variant_loss(*tensors, **keywords):
    """grpo_loss with the variant's LossSettings fields given as keywords beside its tensor keywords."""
    variant = {k: keywords.pop(k) for k in list(keywords) if k in LossSettings.__dataclass_fields__}
    if variant:
        keywords["settings"] = LossSettings(**variant)
    return grpo_loss(*tensors, **keywords)
