"""Dynamic sampling (DAPO): rounds of generation until the step holds enough groups that carry a signal.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv 2503.14476), section
3.2 and Algorithm 1: a group whose G rewards are all equal has advantage 0 on every completion, so it adds
nothing to the policy gradient; DAPO over-samples and keeps filling the batch with groups whose rewards differ
until it holds the batch size (verl: `algorithm.filter_groups`, `max_num_gen_batches`).

Here a step first generates its own rows (prompts_per_step at a time, as without dynamic sampling). While
fewer than `wanted` (the step's prompt count) groups carry a signal and fewer than `max_rounds` rounds have
run, another round of prompts_per_step prompts is drawn from the prompt pool (the run's training rows) with
the step's sampling generator (reseeded from (seed, step) at the start of every step, and drawn from only once
the step's own rows are generated, so their sampling noise is that of a run without dynamic sampling): a
resumed run draws the same prompts again, and the data cursor moves as without dynamic sampling. Groups are
taken in the order they were generated (round by round, rank by rank) until the step has `wanted`; groups past
that, and every flat group, stay out of the loss. At the cap the step trains on the groups with a signal it
found (the metrics say how many).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingRounds:
    """The rounds of one step: iterate for each rollout batch's rows, `take` each batch's groups with a
    signal.

    Without dynamic sampling (dynamic=False) it yields the step's own rows once and `take` keeps every group
    with a signal (drop_zero_std_groups)."""

    rows: Sequence[dict]  # the step's rows
    per_round: int  # prompts per rollout batch (prompts_per_step)
    wanted: int  # groups with a signal the step wants
    max_rounds: int  # the cap on rounds (the step's own rows are round 1)
    pool: Sequence[dict] = ()  # where more prompts come from
    generator: torch.Generator | None = None  # draws them (the step's sampling generator)
    dynamic: bool = True
    report: dict = field(default_factory=dict)  # the rounds' metrics are written here when they end (dynamic)
    rounds: int = 0  # rounds started
    prompts: int = 0  # prompts generated
    taken: int = 0  # groups with a signal taken into the loss
    flat: int = 0  # groups generated without a signal

    @classmethod
    def of_step(cls, config, rows: Sequence[dict], pool: Sequence[dict] | None, generator: torch.Generator,
                report: dict) -> SamplingRounds:
        """The rounds of a step of a run with this GRPOConfig (pool None: the step's own rows)."""
        return cls(rows, config.prompts_per_step, len(rows), config.max_sampling_rounds,
                   rows if pool is None else pool, generator, config.dynamic_sampling, report)

    def __iter__(self) -> Iterator[list[dict]]:
        self.rounds = 1
        for start in range(0, len(self.rows), self.per_round):
            batch = list(self.rows[start:start + self.per_round])
            self.prompts += len(batch)
            yield batch
        while self.dynamic and self.taken < self.wanted and self.rounds < self.max_rounds and len(self.pool):
            self.rounds += 1
            batch = pool_rows(self.pool, self.per_round, self.generator)
            self.prompts += len(batch)
            yield batch
        if self.dynamic:
            self.report.update(self.metrics())

    def take(self, informative: torch.Tensor) -> torch.Tensor:
        """(P,) bool, every group of one rollout batch (all ranks, in rank order) -> (P,) bool: the groups the
        step trains on: those with a signal, while fewer than `wanted` have been taken (all of them when not
        dynamic)."""
        informative = informative.bool()
        self.flat += int((~informative).sum())
        if not self.dynamic:
            self.taken += int(informative.sum())
            return informative
        room = max(self.wanted - self.taken, 0)
        chosen = informative & (informative.long().cumsum(0) <= room)  # (P,) the first `room` with a signal
        self.taken += int(chosen.sum())
        return chosen

    def metrics(self) -> dict:
        return {"dynamic_sampling/rounds": float(self.rounds),
                "dynamic_sampling/prompts": float(self.prompts),
                "dynamic_sampling/groups_with_signal": float(self.taken)}


def pool_rows(pool: Sequence[dict], count: int, generator: torch.Generator | None) -> list[dict]:
    """`count` rows of `pool` drawn without replacement (with, when the pool is smaller) by `generator`."""
    if count <= len(pool):
        order = torch.randperm(len(pool), generator=generator)[:count]
    else:
        order = torch.randint(len(pool), (count,), generator=generator)
    return [pool[i] for i in order.tolist()]
