"""TextArena's games (https://github.com/LeonGuertler/TextArena, `pip install textarena`) as
Forge environments.

The game runs unchanged: `textarena.make(env_id)`, `reset(num_players=1, seed=...)`, `get_observation()`,
`step(action)`, `close()`. What the adapter does, and why:
- the game's turn is one method, `act(action)`, whose text goes to `step` as it is (TextArena parses it: e.g.
  "[5]" in GuessTheNumber); the answer is what the game added to its observation since the model's last
  action, and the end of the game ends the episode (Observation.done) with the game's reward
  as the turn's reward;
- `reset(**row)` draws the game with the row's `seed` (so the G episodes of a row play the same game, and a
  resumed run replays it), and returns the game's opening text, appended to the prompt;
- TextArena seeds Python's global `random` in `reset`, which is not safe when Forge resets episodes in
  parallel threads: resets are serialised by a lock, and the global random state is restored afterwards;
- single-player games only (a second player would be another policy).
"""

from __future__ import annotations

import random
import threading

from forge.envs.protocol import Observation

_RESET_LOCK = threading.Lock()


class TextArenaGame:
    """A one-player TextArena game. Subclass with `env_id`, or use `text_arena_factory(env_id)`."""

    env_id = "GuessTheNumber-v0"

    def reset(self, seed: int = 0, **row) -> str:
        import textarena

        with _RESET_LOCK:
            state = random.getstate()
            self.game = textarena.make(self.env_id)
            self.game.reset(num_players=1, seed=int(seed))
            random.setstate(state)
        _, self.seen = self.game.get_observation()
        self.done, self.reward = False, None
        return self.seen

    def act(self, action: str) -> Observation:
        """Play one move of the game.

        Args:
            action: the move, written as the game's rules ask (e.g. "[5]")
        """
        if self.done:
            return Observation("the game is over", done=True)
        self.done, _ = self.game.step(action)
        if self.done:
            rewards, info = self.game.close()
            self.reward = float((rewards or {}).get(0, 0.0))
            reason = (info or {}).get(0, {}).get("reason", "")
            return Observation(f"game over: {reason}".strip(), reward=self.reward, done=True)
        _, observation = self.game.get_observation()
        new = observation.removeprefix(self.seen)
        self.seen = observation
        return Observation(new.split("\n", 2)[-1].strip() if new.count("\n") >= 2 else new.strip())

    def get_reward(self) -> float:
        return self.reward or 0.0


def text_arena_factory(env_id: str) -> type[TextArenaGame]:
    """An environment class playing TextArena's `env_id`."""
    return type(f"TextArena_{env_id.replace('-', '_')}", (TextArenaGame,), {"env_id": env_id})
