"""`forge demo --env`: the guess-the-number game answers as its rules say, its noise is a function of the row, and
the demo runs end to end on the tiny model, measuring real and noise feedback before and after training."""

import json

import pytest

from forge.cli import main
from forge.demo import DemoSettings, demo_parser
from forge.envs.guess import GuessNumber, NoisyGuessNumber, guess_rows
from forge.model.tiny import build_tiny_model


def test_the_game_answers_with_the_direction_and_what_is_left_and_scores_the_episode():
    game = GuessNumber()
    game.reset(secret=6, high=9)
    assert [game.guess(n).text for n in ("3", "8", " 6 ")] == ["higher, from 4 to 9 (middle 6)", "lower, from 4 to 7 (middle 5)",
                                                              "correct"]
    assert game.guess("x").text == "not a number"
    assert game.found and game.guesses == [3, 8, 6]
    assert game.get_reward() == 1.0
    game.reset(secret=6, high=9)
    game.guess("3"), game.guess("2")  # "higher, from 4 to 9 (middle 6)", then 2: a guess the answer had ruled out
    assert game.get_reward() == pytest.approx(0.5 * 3 / 9)  # not found: half the share of the range ruled out
    game.reset(secret=6, high=9)
    game.guess("5")  # the middle: "higher, from 6 to 9 (middle 7)" rules out 5 of 9
    assert game.get_reward() == pytest.approx(0.5 * 5 / 9)
    assert GuessNumber().get_reward() == 0.0
    with pytest.raises(ValueError, match="feedback must be 'real' or 'noise'"):
        GuessNumber("loud")


def answers(factory, guesses, **row) -> list[str]:
    game = factory()
    game.reset(**row)
    return [game.guess(str(n)).text for n in guesses]


def test_noise_answers_are_the_real_answers_for_a_decoy_drawn_from_the_row():
    decoys = set()
    for episode in range(20):
        row = {"secret": 6, "high": 9, "episode": episode}
        noise = answers(NoisyGuessNumber, range(1, 10), **row)
        assert noise == answers(NoisyGuessNumber, range(1, 10), **row)  # a function of the row: resumes bitwise
        assert noise[5] == "correct"  # the hidden number still wins
        decoy = next(d for d in range(1, 10) if d != 6 and all(
            answers(NoisyGuessNumber, [n], **row) == answers(GuessNumber, [n], secret=d, high=9)
            for n in range(1, 10) if n not in (d, 6)))
        decoys.add(decoy)
    assert len(decoys) > 3  # drawn, not fixed
    rows = guess_rows([7, 9], turns=4, repeats=2)
    assert len(rows) == 2 * (7 + 9) and {r["secret"] for r in rows if r["high"] == 7} == set(range(1, 8))


def test_the_env_demo_runs_end_to_end_on_the_tiny_model(tmp_path, capsys):
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    assert main(["demo", "--env", "--model", str(tmp_path / "tiny"), "--steps", "1", "--prompts_per_step", "2",
                 "--group_size", "2", "--heldout", "4", "--max_new_tokens", "8", "--dtype", "float32",
                 "--output_dir", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "demo_env_result.json").read_text())
    for phase in ("before", "after"):
        assert set(result[phase]) == {"real", "noise"}
        assert result[phase]["real"]["n"] == 4 and 0 <= result[phase]["real"]["success"] <= 1
    assert "guesses/episode" in capsys.readouterr().out


def test_the_env_demo_has_its_recipe_unless_told_otherwise():
    args, _ = demo_parser(["--env"]).parse_known_args(["--env"])
    settings = DemoSettings.from_args(args)
    assert settings.env and settings.steps == 30 and settings.heldout == 48
    args, _ = demo_parser(["--env", "--steps", "5"]).parse_known_args(["--env", "--steps", "5"])
    assert DemoSettings.from_args(args).steps == 5
