"""A config that a callback changes between steps, checked again as at start-up.

TRL's callbacks get the config as `args` and may change it between steps (anneal the temperature, shorten
max_new_tokens): the next step reads the new values. The run loop (forge/run/loop.py) asks
`ConfigWatch.problem()` wherever a callback may have changed it, before the changed values are used: after the
callbacks of a step's end and of its log row, and before the next step. A change is refused with the words
GRPOConfig.validate() says at start-up, and so is a change of what the run built from the config when it
started and never builds again (`BUILT_AT_START`), and kl_beta > 0 for a full fine-tune that started without a
reference model.
"""

from __future__ import annotations

import json
from typing import Any

from forge.run.checkpoint_fields import COMPATIBILITY_KEYS

_SCHEDULE = "the steps' rows were laid out for it at start, and every checkpoint records it for --resume"
_POLICY = "the policy (LoRA adapters or full weights) and its optimizer were built for it at start"
# What the run built from these settings when it started; a new value would not take effect, or would not fit.
# Those that --resume compares (COMPATIBILITY_KEYS) among them.
BUILT_AT_START = {
    **{key: _POLICY if "lora" in key else _SCHEDULE for key in COMPATIBILITY_KEYS if key != "model_name"},
    "fsdp": "the processes' shards were laid out at start",
    "dtype": "the precision was chosen at start",
    "generation_backend": "the sampler was opened at start",
    "vllm_mode": "the sampler was opened at start",
    "max_staleness": "the rollout worker (or none) started with the run",
    "teacher_model": "the teacher was loaded at start",
    "output_dir": "the run claimed that folder at start, and writes its checkpoints and logs there",
}


class ConfigWatch:
    """The config as the run started (`config`: the live object the callbacks change), and whether the run has
    a reference model to compute a KL term against (`has_reference`: LoRA, or a full
    fine-tune's frozen copy)."""

    def __init__(self, config: Any, has_reference: bool):
        self.config, self.has_reference = config, has_reference
        self.started = self.checked = _plain(config.to_dict())

    def problem(self) -> str | None:
        """Why the run cannot go on with the config as it is now, or None (also when nothing changed since the
        last check): validate()'s problems, a setting of BUILT_AT_START changed, or a KL term
        without a reference."""
        now = _plain(self.config.to_dict())
        if now == self.checked:
            return None
        try:
            self.config.validate()
        except ValueError as error:
            return str(error).removeprefix("invalid GRPOConfig:\n  - ").replace("\n  - ", "; ")
        changed = [f"{name}={now[name]!r} (it was {self.started[name]!r}): {why}"
                   for name, why in BUILT_AT_START.items() if now[name] != self.started[name]]
        if self.config.kl_beta > 0 and not self.has_reference:
            changed.append(
                f"kl_beta={self.config.kl_beta} needs the frozen reference model, which a full fine-tune "
                f"builds at start only when kl_beta > 0 (this run started with kl_beta=0); start it with "
                f"a kl_beta > 0 to change it later, or use LoRA"
            )
        if changed:
            return "; ".join(changed) + ": set it back in the callback"
        self.checked = now
        return None


def _plain(values: dict) -> dict:
    """The config as JSON sees it, so a tuple and the list a callback sets instead compare equal."""
    return json.loads(json.dumps(values, default=str))


__all__ = ["BUILT_AT_START", "ConfigWatch"]
