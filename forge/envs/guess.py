"""Guess the number: an environment whose answers are the only way to win (the `forge demo --env` game).

The model looks for a hidden number from 1 to `high` in `turns` guesses. A wrong guess is answered with the
direction, the numbers the answers so far leave and their middle ("higher, from 6 to 10 (middle 8)"); a right
one with "correct". A policy that ignores the answers finds the number with probability turns / high at best;
one that guesses the middle it is told always finds it (high <= 2**turns - 1). `feedback="noise"` answers as
if the hidden number were a decoy (another number of the range, drawn from the row): the answers read the same
and stay consistent, but carry no information about the number that wins, which measures how much of a
policy's success comes from reading them.
"""

from __future__ import annotations

import random
import re

from forge.envs.protocol import Observation

EXAMPLE = (
    "<guess>5</guess><result>higher, from 6 to 10 (middle 8)</result><guess>8</guess><result>higher, from 9 "
    "to 10 (middle 9)</result><guess>9</guess><result>correct</result>"
)

RULES = (
    "Find my secret number. Guess by writing <guess>N</guess>. If N is wrong I answer higher or lower, the "
    "numbers still possible and their middle, like <result>higher, from 6 to 10 (middle 8)</result>; if you "
    "found it, <result>correct</result>. You have {turns} guesses."
)


def guess_prompt(high: int, turns: int) -> list[dict]:
    """The chat prompt: the rules and one worked game as an earlier exchange (a bisection for the number 9 in
    1..10), then the new game. (Measured on SmolLM2-135M-Instruct: with the example inside one user message,
    or in a system message, the model does not play at all; as an earlier exchange it makes
    its first guess.)"""
    return [{"role": "user", "content": RULES.format(turns=turns) + " My number is from 1 to 10."},
            {"role": "assistant", "content": EXAMPLE},
            {"role": "user", "content": f"Correct! New game: my number is from 1 to {high}."}]


def guess_rows(highs: list[int], turns: int, repeats: int = 1, seed: int = 0) -> list[dict]:
    """Rows {prompt, secret, high, episode}: every secret of every range `repeats` times,
    in a seeded order."""
    rows = [{"prompt": guess_prompt(high, turns), "secret": secret, "high": high, "episode": k}
            for high in highs for secret in range(1, high + 1) for k in range(repeats)]
    random.Random(seed).shuffle(rows)
    return rows


NARROWING_WEIGHT = 0.5  # the most a game not won pays: for the share of the range its answers ruled out


class GuessNumber:
    """The game. `feedback`: 'real' (the answers) or 'noise' (answers for a decoy number)."""

    def __init__(self, feedback: str = "real"):
        if feedback not in ("real", "noise"):
            raise ValueError(f"feedback must be 'real' or 'noise', got {feedback!r}")
        self.feedback = feedback
        self.secret, self.high, self.found, self.guesses = 0, 1, False, []
        self.low_bound, self.high_bound = 1, 1

    def reset(self, secret: int, high: int = 10, episode: int = 0, **row) -> None:
        self.secret, self.high, self.found, self.guesses = int(secret), int(high), False, []
        self.low_bound, self.high_bound = 1, int(high)  # what the answers so far leave
        others = [n for n in range(1, self.high + 1) if n != self.secret] or [self.secret]
        # The number the answers are about: the secret, or a decoy drawn from the row (so a resume redraws
        # it).
        self.answered = self.secret if self.feedback == "real" else random.Random(
            f"{secret}:{high}:{episode}").choice(others)

    def guess(self, number: str) -> Observation:
        """Guess the secret number.

        Args:
            number: the guess, a whole number
        """
        match = re.fullmatch(r"\s*(-?\d+)\s*", str(number))
        if match is None:
            return Observation("not a number")
        value = int(match.group(1))
        self.guesses.append(value)
        if value == self.secret:
            self.found = True
            return Observation("correct", reward=1.0, done=True)
        if value < self.answered or (value == self.answered and value < self.high_bound):
            self.low_bound, direction = max(self.low_bound, value + 1), "higher"
        else:
            self.high_bound, direction = min(self.high_bound, value - 1), "lower"
        middle = (self.low_bound + self.high_bound) // 2
        return Observation(f"{direction}, from {self.low_bound} to {self.high_bound} (middle {middle})")

    def get_reward(self) -> float:
        """1 when found; otherwise NARROWING_WEIGHT x the share of the range the answers ruled out. Guessing
        the middle of what is left rules out the most; a guess at an edge rules out one number."""
        if self.found:
            return 1.0
        left = max(0, self.high_bound - self.low_bound + 1)
        return NARROWING_WEIGHT * (1 - left / self.high) if self.guesses else 0.0


class NoisyGuessNumber(GuessNumber):
    """GuessNumber whose answers are about a decoy number (a factory for `feedback='noise'`)."""

    def __init__(self):
        super().__init__("noise")
