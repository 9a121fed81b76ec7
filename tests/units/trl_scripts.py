"""What the TRL-script tests share: their prompts and TRL's config for them, TRL 1.16.0's batch figures for a
config (`trl_batches`, derived from its code), and what each optimizer step of a Forge run trained on
(`Counts`), to hold the two against each other."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from forge import GRPOConfig

PROMPTS = ["What is 2 + 3?", "Name a color.", "Count to three.", "Say yes."]


def trl_args(tmp_path, **overrides) -> GRPOConfig:
    """A GRPOConfig written with TRL's names, as a TRL script writes it (two steps on the tiny model)."""
    values = {"output_dir": str(tmp_path / "out"), "logging_steps": 1, "num_generations": 4,
              "max_completion_length": 8, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
              "max_steps": 2, "learning_rate": 1e-2, "beta": 0.0, "report_to": "none",
              "preflight": "off"}  # the rewards' calls are counted from step 1
    return GRPOConfig(**(values | overrides))


@dataclasses.dataclass
class ModelArguments:
    """The fields of TRL's ModelConfig (trl/trainer/model_config.py) a GRPOConfig has too, declared as there,
    and a few others, without needing TRL."""

    model_name_or_path: str | None = None
    model_revision: str = "main"
    dtype: str | None = dataclasses.field(
        default="float32",
        metadata={"help": "load dtype", "choices": ["auto", "bfloat16", "float16", "float32"]})
    attn_implementation: str | None = None
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class Batches:
    """What a run's optimizer steps train on."""

    optimizer_steps: int
    completions_per_step: int  # of one optimizer step, every process
    completions_per_pass: int  # of one forward/backward on a process
    prompts_per_generation: int  # sampled at once, num_generations completions each
    generations: int
    prompts_per_step: Fraction  # prompts sampled per optimizer step (1/2: a generation of 1 feeds 2 steps)


def trl_batches(rows: int, *, num_generations: int = 8, per_device_train_batch_size: int = 8,
                gradient_accumulation_steps: int = 1, generation_batch_size: int | None = None,
                steps_per_generation: int | None = None, num_iterations: int = 1, max_steps: int = -1,
                num_train_epochs: float = 3.0, **_) -> Batches:
    """TRL 1.16.0's figures for a config on one process and `rows` prompts, from its code (the wheel):

    trl/trainer/grpo_config.py, GRPOConfig.__post_init__ (l. 1098-1135): steps_per_generation S defaults to
        gradient_accumulation_steps, or is generation_batch_size / B, with B = per_device_train_batch_size x
        processes; generation_batch_size = B x S, a multiple of num_generations G.
    trl/trainer/grpo_trainer.py: the train dataloader's batch is per_device_train_batch_size x S (l. 1275),
        drawn by a RepeatSampler of generation_batch_size / G prompts per chunk, each repeated G times, each
        chunk num_iterations x S times (l. 1309-1316); its length (trl/trainer/utils.py l. 951-952) is
        (rows // P) x P x G x num_iterations x S, P the prompts of a chunk. _prepare_inputs (l. 1538-1546)
        generates every S x num_iterations passes and feeds slice `_step % S` of the generation to a pass.
    transformers' Trainer.set_initial_training_values (trainer.py l. 2558-2566): an optimizer step every
        gradient_accumulation_steps passes (the last one of an epoch may be short), max_steps when above 0,
        else ceil(num_train_epochs x steps per epoch).
    """
    g, b, accumulation = num_generations, per_device_train_batch_size, gradient_accumulation_steps
    if generation_batch_size is None:
        steps = accumulation if steps_per_generation is None else steps_per_generation
        generation_batch_size = b * steps
    else:
        assert generation_batch_size % b == 0, "TRL refuses it"
        steps = generation_batch_size // b
    assert generation_batch_size % g == 0, "TRL refuses it"
    prompts = generation_batch_size // g
    sampled = (rows // prompts) * prompts * g * num_iterations * steps
    passes = math.ceil(sampled / (per_device_train_batch_size * steps))
    per_epoch = max(passes // accumulation + int(passes % accumulation > 0), 1)
    optimizer_steps = max_steps if max_steps > 0 else math.ceil(num_train_epochs * per_epoch)
    generations = math.ceil(optimizer_steps * accumulation / (steps * num_iterations))
    return Batches(optimizer_steps, b * accumulation, per_device_train_batch_size, prompts, generations,
                   Fraction(b * accumulation, g))


@dataclasses.dataclass
class Counts:
    """What a Forge trainer's run sampled and trained on: the prompts of each generation (once training has
    begun: the preflight's sampling is not one) and each forward/backward's (optimizer step, completions)."""

    generations: list[int] = dataclasses.field(default_factory=list)
    passes: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, trainer) -> Counts:
        counts, sample, loss = cls(), trainer.sample_completions, trainer.loss_and_backward

        def counted_sample(prompts, rows=None):
            if trainer.state.max_steps:  # set when training begins, after the preflight
                counts.generations.append(len(prompts))
            return sample(prompts, rows)

        def counted_loss(batch, r, indices, normaliser, totals):
            counts.passes.append((trainer.global_step + 1, len(indices)))
            return loss(batch, r, indices, normaliser, totals)

        trainer.sample_completions, trainer.loss_and_backward = counted_sample, counted_loss
        return counts

    def batches(self) -> Batches:
        steps = sorted({step for step, _ in self.passes})
        per_step = {sum(n for at, n in self.passes if at == step) for step in steps}
        per_pass, per_generation = {n for _, n in self.passes}, set(self.generations)
        assert len(per_step) == len(per_pass) == len(per_generation) == 1, (per_step, per_pass,
                                                                            per_generation)
        return Batches(len(steps), per_step.pop(), per_pass.pop(), per_generation.pop(),
                       len(self.generations), Fraction(sum(self.generations), len(steps)))


class CountedTrainer:
    """Mixed into a Forge trainer class: each instance keeps its Counts (for scripts that build the trainer
    inside a function of theirs, as TRL's grpo.py main() does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts = Counts.of(self)
