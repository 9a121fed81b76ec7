"""What `forge` makes of its options: TRL's GRPOConfig names as flags and YAML keys, unknown flags named with the
closest ones, the output dir checked before the model loads, --chat for string prompts, and evaluation with
rewards where the math grader cannot read the references. In this process, on the tiny offline model."""

import json

import pytest
import yaml

from forge.cli import _training_data, build_config, build_parser, main
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

NUMBERS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]
WORDS = [{"prompt": f"Capital of {country}?", "reference": city}
         for country, city in [("France", "Paris"), ("Peru", "Lima"), ("Japan", "Tokyo"), ("Chad", "N'Djamena")]]
REWARD = "def vowels(prompts, completions, **kwargs):\n    return [float(sum(c in 'aeiou' for c in t)) for t in completions]\n"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    for name, rows in (("numbers.jsonl", NUMBERS), ("words.jsonl", WORDS)):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "rewards.py").write_text(REWARD)
    return root


def forge_main(*argv) -> int:
    return main([str(a) for a in argv])


def train_flags(workspace, out) -> list:
    return ["--model", workspace / "tiny", "--dataset", workspace / "numbers.jsonl", "--reward",
            f"{workspace / 'rewards.py'}:vowels", "--group_size", "2", "--max_new_tokens", "4", "--logging_steps", "1",
            "--save_steps", "0", "--output_dir", out]


@pytest.fixture
def no_model_loading(monkeypatch):
    import forge.core.trainer

    def loads_a_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(forge.core.trainer, "GRPOTrainer", loads_a_model)


def error_of(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "forge: error: " in err, err
    return err[err.index("forge: error: "):]


# ----------------------------------------------------------------------------------------------------
# TRL's names and unknown flags


def test_trl_names_are_forge_train_flags(capsys):
    parser = build_parser()
    config = build_config(parser.parse_args([
        "train", "--num_generations", "4", "--max_completion_length", "32", "--beta", "0.0", "--epsilon", "0.3",
        "--lr_scheduler_type", "constant", "--per_device_train_batch_size", "8", "--report_to", "wandb", "--bf16"]))
    assert (config.group_size, config.max_new_tokens, config.kl_beta, config.clip_epsilon) == (4, 32, 0.0, 0.3)
    assert config.lr_scheduler == "constant" and config.prompts_per_step == 2  # 8 completions / 4 per prompt
    assert (config.use_wandb, config.use_tensorboard, config.dtype) == (True, False, "bfloat16")
    config = build_config(parser.parse_args(["train", "--report_to", "tensorboard,wandb", "--fp16", "false"]))
    assert (config.use_wandb, config.use_tensorboard, config.dtype) == (True, True, "auto")
    with pytest.raises(SystemExit):
        forge_main("train", "--help")
    assert "--num_generations" in capsys.readouterr().out


def test_training_arguments_names_are_forge_train_flags():
    config = build_config(build_parser().parse_args([
        "train", "--save_strategy", "no", "--eval_strategy", "steps", "--logging_steps", "3", "--warmup_steps",
        "0.2", "--run_name", "r", "--optim", "adamw_torch", "--resume_from_checkpoint", "true"]))
    assert (config.save_steps, config.eval_steps, config.warmup_ratio, config.wandb_run_name, config.resume_from) == (
        0, 3, 0.2, "r", "latest")


def test_a_switch_on_by_default_is_turned_off_with_no(tmp_path):
    """`--no_<name>`, as transformers spells it, for Forge's switches that default to True and TRL's."""
    parser = build_parser()
    config = build_config(parser.parse_args(["train", "--no_shuffle", "--no_share_prompt_prefix",
                                             "--no_merge_lora_for_generation", "--no_gradient_checkpointing"]))
    assert (config.shuffle, config.share_prompt_prefix, config.merge_lora_for_generation) == (False, False, False)
    assert not config.gradient_checkpointing
    assert not build_config(parser.parse_args(["train", "--no_shuffle_dataset"])).shuffle
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"shuffle": True}))
    assert not build_config(parser.parse_args(["train", "--config", str(path), "--no_shuffle"])).shuffle  # flag wins
    config = build_config(parser.parse_args(["train"]))
    assert (config.shuffle, config.share_prompt_prefix, config.merge_lora_for_generation) == (True, True, True)


def test_trl_names_in_a_yaml_file_and_flags_win_whichever_name_they_use(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"num_generations": 4, "beta": "1e-3", "per_device_train_batch_size": 8,
                                    "report_to": ["tensorboard"]}))
    parser = build_parser()
    config = build_config(parser.parse_args(["train", "--config", str(path)]))
    assert (config.group_size, config.kl_beta, config.prompts_per_step) == (4, 1e-3, 2)
    assert (config.use_tensorboard, config.use_wandb) == (True, False)
    config = build_config(parser.parse_args(["train", "--config", str(path), "--group_size", "2", "--kl_beta", "0.5",
                                             "--report_to", "none"]))
    assert (config.group_size, config.kl_beta, config.prompts_per_step) == (2, 0.5, 4)
    assert not config.use_tensorboard


def test_trl_batch_names_follow_trls_arithmetic_across_a_yaml_file_and_flags(tmp_path):
    """TRL's out-of-memory advice, split between the file and the command line: one prompt's 8 completions per
    optimizer step, one per forward/backward (gradient_accumulation_steps is TRL's, an input of the batch)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"num_generations": 8, "per_device_train_batch_size": 1}))
    parser = build_parser()
    config = build_config(parser.parse_args(["train", "--config", str(path), "--gradient_accumulation_steps", "8"]))
    assert (config.prompts_per_step, config.gradient_accumulation_steps, config.micro_batch_size) == (1, 1, 1)
    config = build_config(parser.parse_args(["train", "--config", str(path), "--prompts_per_step", "3"]))
    assert (config.prompts_per_step, config.gradient_accumulation_steps) == (3, 4)  # Forge's batch: its names win


@pytest.mark.parametrize("argv, message", [
    (["train", "--vllm_mode", "nearby"], "vllm_mode='nearby': use 'colocate' or 'server'"),
    (["train", "--num_generation", "4"], "forge train: unknown option --num_generation (did you mean --num_generations"),
    (["train", "--learning_rat", "1e-5"], "unknown option --learning_rat (did you mean --learning_rate"),
    (["train", "--num_generations", "4", "--group_size", "2"], "got both 'num_generations' (TRL's name) and 'group_"),
    (["eval", "--modle", "x"], "forge eval: unknown option --modle (did you mean --model?)"),
    (["plot", "out", "--outt", "x.png"], "forge plot: unknown option --outt (did you mean --out?)"),
    (["screen", "--grup_size", "4"], "forge screen: unknown option --grup_size (did you mean --group_size?)"),
    (["export", "--adapter", "a", "--out", "b", "--bse", "x"], "unknown option --bse (did you mean --base?)"),
    (["demo", "--stepz", "3"], "forge demo: unknown option --stepz (did you mean --steps"),
    (["train", "extra"], "forge train: unexpected arguments: extra"),
])
def test_an_unknown_or_refused_flag_is_one_message_with_exit_2(argv, message, capsys, no_model_loading):
    assert forge_main(*argv) == 2
    assert message in error_of(capsys)


# ----------------------------------------------------------------------------------------------------
# the output dir, before the model loads


def test_the_output_dir_is_checked_before_the_model_loads(workspace, tmp_path, capsys, no_model_loading):
    used = tmp_path / "used"
    (used / "1").mkdir(parents=True)  # an earlier Forge's checkpoint: named `{step}`, from before checksums
    (used / "1" / "COMPLETE").write_text("ok\n")
    (used / "training_log.jsonl").write_text('{"step": 1}\n')
    assert forge_main("train", *train_flags(workspace, used)) == 2
    assert f"output_dir={str(used)!r} already holds a run (1, training_log.jsonl). Continue it with --resume" in \
        error_of(capsys)
    (tmp_path / "a_file").write_text("")
    assert forge_main("train", *train_flags(workspace, tmp_path / "a_file" / "out")) == 2
    assert "is not writable" in error_of(capsys)
    with pytest.raises(AssertionError, match="the model was loaded"):  # --resume: the directory is fine
        forge_main("train", *train_flags(workspace, used), "--resume")


# ----------------------------------------------------------------------------------------------------
# --chat and string prompts


def test_chat_true_wraps_the_string_prompts_of_a_jsonl_file(workspace):
    tokenizer = build_tiny_tokenizer()  # it has a chat template
    data = str(workspace / "numbers.jsonl")
    args = build_parser().parse_args(["train", "--dataset", data, "--eval_dataset", data, "--chat", "true"])
    rows, eval_rows = _training_data(args, tokenizer)
    assert [row["prompt"] for row in rows] == [[{"role": "user", "content": row["prompt"]}] for row in NUMBERS]
    assert eval_rows[0]["prompt"] == [{"role": "user", "content": NUMBERS[0]["prompt"]}]
    with pytest.warns(UserWarning, match=r"8 prompts are plain strings and the tokenizer has a chat template: they "
                                         r"reach the model as raw text.*--chat true"):
        rows, _ = _training_data(build_parser().parse_args(["train", "--dataset", data, "--eval_dataset", data]),
                                 tokenizer)
    assert rows[0]["prompt"] == NUMBERS[0]["prompt"]  # as given
    rows, _ = _training_data(build_parser().parse_args(["train", "--dataset", data, "--chat", "false"]), tokenizer)
    assert rows[0]["prompt"] == NUMBERS[0]["prompt"]


# ----------------------------------------------------------------------------------------------------
# evaluating with rewards


def test_forge_eval_reward_reports_the_mean_reward_of_greedy_completions(workspace, tmp_path, capsys):
    with pytest.warns(UserWarning, match="4 of 4 references are not numbers or math the grader reads"):
        assert forge_main("eval", "--model", workspace / "tiny", "--data", workspace / "words.jsonl", "--reward",
                          f"{workspace / 'rewards.py'}:vowels:0.5", "--max_new_tokens", "4", "--chat", "true",
                          "--out", tmp_path) == 0
    metrics = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    assert metrics["n"] == 4 and metrics["reward"] == pytest.approx(0.5 * metrics["rewards/vowels/mean"])
    assert '"rewards/vowels/mean"' in capsys.readouterr().out
    assert forge_main("eval", "--compare", "a", "b", "--reward", "number") == 2
    assert "--reward scores one model's greedy completions: use it with --model, not --compare" in error_of(capsys)


def test_training_evaluates_text_references_with_the_run_rewards(workspace, tmp_path, capsys):
    for data, out in (("words.jsonl", tmp_path / "words"), ("numbers.jsonl", tmp_path / "numbers")):
        assert forge_main("train", *train_flags(workspace, out), "--eval_dataset", workspace / data, "--max_steps",
                          "1", "--eval_steps", "1", "--chat", "true") == 0
    printed = capsys.readouterr()
    words = [row for row in map(json.loads, (tmp_path / "words" / "training_log.jsonl").open()) if "eval_n" in row]
    numbers = [row for row in map(json.loads, (tmp_path / "numbers" / "training_log.jsonl").open())
               if "eval_n" in row]
    assert words and all("eval_reward" in row and "eval_strict_accuracy" not in row for row in words)
    assert numbers and all("eval_strict_accuracy" in row for row in numbers)
    assert printed.err.count("most references are not numbers the math grader reads, so evaluation reports the "
                             "mean reward of greedy completions under --reward") == 1
    assert "step 1 | eval | reward " in printed.out and "step 1 | eval | strict_accuracy " in printed.out
