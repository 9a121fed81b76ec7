"""Environments the policy acts in during rollouts: per-episode state, one instance per completion, TRL's
`environment_factory` protocol (protocol.py); the rollout runs them through its one decode loop."""

from forge.envs.protocol import (
    EnvironmentSettings,
    Episode,
    Observation,
    env_rewards,
    environment_methods,
    environment_reward,
    episode_return,
    load_environment,
    rollout_tools,
    with_opening,
)

__all__ = ["EnvironmentSettings", "Episode", "Observation", "env_rewards", "environment_methods",
           "environment_reward", "episode_return", "load_environment", "rollout_tools", "with_opening"]
