"""Guess the number: an environment whose feedback is the only way to win (the `forge demo --env` game).

The model looks for a hidden number from 1 to `high` in `turns` guesses; each guess is answered "higher",
"lower" or "correct". A policy that ignores the answers finds the number with probability turns / high at best;
one that bisects always finds it (high <= 2**turns - 1). `feedback="noise"` answers a wrong guess with a random
"higher" or "lower" (seeded by the row) instead: the same game with the information taken out, which measures
how much of a policy's success comes from reading the answers.
"""

from __future__ import annotations

import random
import re

from forge.envs.protocol import Observation

EXAMPLE = ("<guess>5</guess><result>higher</result><guess>8</guess><result>lower</result>"
           "<guess>7</guess><result>correct</result>")


RULES = ("Find my secret number. Guess by writing <guess>N</guess>. I answer <result>higher</result> if my number "
         "is higher than N, <result>lower</result> if it is lower, <result>correct</result> if you found it. You "
         "have {turns} guesses.")


def guess_prompt(high: int, turns: int) -> list[dict]:
    """The chat prompt: the rules and one worked game as an earlier exchange (a bisection for the number 7 in
    1..10), then the new game. (Measured on SmolLM2-135M-Instruct: with the example inside one user message, or
    in a system message, the model does not play at all; as an earlier exchange it makes its first guess.)"""
    return [{"role": "user", "content": RULES.format(turns=turns) + " My number is from 1 to 10."},
            {"role": "assistant", "content": EXAMPLE},
            {"role": "user", "content": f"Correct! New game: my number is from 1 to {high}."}]


def guess_rows(highs: list[int], turns: int, repeats: int = 1, seed: int = 0) -> list[dict]:
    """Rows {prompt, secret, high, episode}: every secret of every range `repeats` times, in a seeded order."""
    rows = [{"prompt": guess_prompt(high, turns), "secret": secret, "high": high, "episode": k}
            for high in highs for secret in range(1, high + 1) for k in range(repeats)]
    random.Random(seed).shuffle(rows)
    return rows


CONSISTENCY_BONUS = 0.1  # per guess after an answer that stays inside the range the answers leave (reading them)


class GuessNumber:
    """The game. `feedback`: 'real' (the answers) or 'noise' (a wrong guess gets a random direction)."""

    def __init__(self, feedback: str = "real"):
        if feedback not in ("real", "noise"):
            raise ValueError(f"feedback must be 'real' or 'noise', got {feedback!r}")
        self.feedback = feedback
        self.secret, self.found, self.guesses, self.consistent = 0, False, [], 0

    def reset(self, secret: int, high: int = 10, episode: int = 0, **row) -> None:
        self.secret, self.high, self.found, self.guesses = int(secret), int(high), False, []
        self.low_bound, self.high_bound, self.consistent = 1, int(high), 0  # what the answers so far allow
        self.noise = random.Random(f"{secret}:{high}:{episode}")  # a function of the row: resumes bitwise

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
        self.consistent += len(self.guesses) > 1 and self.low_bound <= value <= self.high_bound
        if value == self.secret:
            self.found = True
            return Observation("correct", reward=1.0, done=True)
        answer = self.noise.choice(["higher", "lower"]) if self.feedback == "noise" else (
            "higher" if self.secret > value else "lower")
        if answer == "higher":
            self.low_bound = max(self.low_bound, value + 1)
        else:
            self.high_bound = min(self.high_bound, value - 1)
        return Observation(answer)

    def get_reward(self) -> float:
        """1 when found, plus CONSISTENCY_BONUS for each later guess that the earlier answers allowed."""
        return (1.0 if self.found else 0.0) + CONSISTENCY_BONUS * self.consistent


class NoisyGuessNumber(GuessNumber):
    """GuessNumber with the answers replaced by noise (a factory for `feedback='noise'`)."""

    def __init__(self):
        super().__init__("noise")
