"""Tasks from the ecosystem: GSM8K chat prompts, reasoning-gym tasks with their own scorer, hf: datasets.

Everything runs offline: reasoning-gym generates its problems locally, and the hf: tests read datasets
written to a temporary folder (``save_to_disk``, a parquet file, a folder of JSON files).
"""

import json
import sys
import types

import pytest

from forge.core.reward import MathCorrectnessReward, TagFormatReward, call_with_accepted_kwargs
from forge.core.reward_sources import as_reward
from forge.core.scoring import reward_kwargs
from forge.data.answers import extract_final_answer
from forge.data.dataset import (
    BUILTIN_DATASETS,
    builds_prompts,
    load_rows,
    pick_chat,
    source_kwargs,
    task_for,
    validate_rows,
)
from forge.data.dataset import TASKS as TASK_TABLE
from forge.data.gsm8k import (
    FEW_SHOT_EXAMPLES,
    GSM8K_CHAT_REMINDER,
    GSM8K_CHAT_SYSTEM_PROMPT,
    GSM8K_MOCK_PROBLEMS,
    chat_prompt,
    format_prompt,
    gsm8k_rows_from_records,
    gsm_hard_rows_from_records,
    load_gsm8k_mock,
)
from forge.eval.evaluate import evaluate, load_eval_rows
from forge.eval.metrics import CORRECT, NO_ANSWER, WRONG_ANSWER, detect_answer_format, grade

# ----------------------------------------------------------------------------------------------------------
# GSM8K for chat models


def test_plain_gsm8k_prompt_is_the_original_design_unchanged():
    question = "Tom has 3 apples. How many?"
    assert format_prompt(question) == (
        "You are a math reasoning assistant. Solve the problem step by step.\n"
        "At the end of your solution, write the final answer on its own line in the format: Answer: <number>"
        f"\n\nProblem: {question}\n\nSolution:")
    assert [row["prompt"] for row in load_gsm8k_mock()] == [format_prompt(q) for q, _ in GSM8K_MOCK_PROBLEMS]


def test_gsm8k_chat_prompt_has_a_system_prompt_and_worked_examples_as_turns():
    question = GSM8K_MOCK_PROBLEMS[0][0]
    messages = chat_prompt(question)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"] == GSM8K_CHAT_SYSTEM_PROMPT and "<answer>" in GSM8K_CHAT_SYSTEM_PROMPT
    assert messages[-1] == {"role": "user", "content": question + GSM8K_CHAT_REMINDER}
    assert "<answer>" in GSM8K_CHAT_REMINDER
    for (example_question, _solution, answer), user, assistant in zip(FEW_SHOT_EXAMPLES, messages[1::2], messages[2::2]):
        assert user["content"] == example_question + GSM8K_CHAT_REMINDER
        # every worked example is graded correct by the same code the rewards and the evaluation use
        assert grade(assistant["content"], answer, "tag").strict_correct
        assert MathCorrectnessReward(strict=True)([""], [assistant["content"]], references=[answer]).scores == [1.0]
        assert TagFormatReward()([""], [assistant["content"]]).scores == [1.0]
    assert len(chat_prompt(question, n_shots=0)) == 2
    with pytest.raises(ValueError, match="n_shots"):
        chat_prompt(question, n_shots=99)


def test_gsm8k_loaders_take_chat_and_the_grader_reads_tags():
    rows = load_gsm8k_mock(chat=True)
    validate_rows(rows)
    assert len(rows) == 20 and all(detect_answer_format(row["prompt"]) == "tag" for row in rows)
    assert [(row["question"], row["reference"]) for row in rows] == list(GSM8K_MOCK_PROBLEMS)
    records = [{"question": "Q?", "answer": "work\n#### 1,234"}]
    assert gsm8k_rows_from_records(records, chat=True)[0]["prompt"] == chat_prompt("Q?")
    assert gsm8k_rows_from_records(records)[0]["prompt"] == format_prompt("Q?")
    assert gsm_hard_rows_from_records([{"input": "Q?", "target": 7.0}], chat=True)[0] == {
        "prompt": chat_prompt("Q?"), "reference": "7", "question": "Q?"}
    assert load_rows("gsm8k-mock", chat=True) == rows


def test_eval_rows_keep_each_sets_default_and_follow_an_explicit_chat():
    assert detect_answer_format(load_eval_rows("gsm8k-mock", n=2)[0]["prompt"]) == "answer_line"  # as before
    assert load_eval_rows("gsm8k-mock", n=2, chat=True)[0]["prompt"] == chat_prompt(GSM8K_MOCK_PROBLEMS[0][0])
    assert isinstance(load_eval_rows("arithmetic", n=2, chat=False)[0]["prompt"], str)


def test_chat_default_follows_the_tokenizer_and_says_so(tiny_tokenizer, capsys):
    assert pick_chat(None, tiny_tokenizer, "gsm8k-mock") is True
    assert "chat template" in capsys.readouterr().err

    class Plain:
        chat_template = None

    assert pick_chat(None, Plain(), "gsm8k") is False
    assert "no chat template" in capsys.readouterr().err
    assert pick_chat(False, tiny_tokenizer, "gsm8k") is False and capsys.readouterr().err == ""
    assert pick_chat(None, tiny_tokenizer, "rows.jsonl") is True and capsys.readouterr().err == ""  # not announced
    assert builds_prompts("reasoning-gym:chain_sum") and builds_prompts("hf:a/b") and not builds_prompts("x.jsonl")
    assert source_kwargs("x.jsonl", chat=True) == {}


def test_chat_flag_bare_or_with_a_value():
    from forge.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["train", "--dataset", "gsm8k", "--chat"]).chat is True
    assert parse(["train", "--chat", "false"]).chat is False
    assert parse(["eval", "--data", "gsm8k-mock"]).chat is None
    assert parse(["eval", "--chat", "true", "--prompt_column", "q", "--reference_column", "a"]).prompt_column == "q"


def test_evaluate_model_on_the_mock_set_picks_chat_prompts_for_a_chat_tokenizer(tiny_model, tiny_tokenizer):
    from forge.eval.evaluate import evaluate_model

    result = evaluate_model((tiny_model, tiny_tokenizer), data="gsm8k-mock", n=2, max_new_tokens=3)
    assert result.records[0]["answer_format"] == "tag" and isinstance(result.records[0]["prompt"], list)
    plain = evaluate_model((tiny_model, tiny_tokenizer), data="gsm8k-mock", n=2, max_new_tokens=3, chat=False)
    assert plain.records[0]["answer_format"] == "answer_line"
    assert 0.0 <= result.metrics["nonempty_rate"] <= 1.0


# ----------------------------------------------------------------------------------------------------------
# Every built-in task: the training reward pays what the evaluation counts as right

TABLE = (  # (completion, the reward it earns, strictly correct); {ref} is the row's answer, {wrong} another number
    ("<think>work</think>\n<answer>{ref}</answer>", 1.0, True),  # right, where the prompt asks for it
    ("The answer is {ref}", 1.0, False),  # right, but not in an <answer> tag: the reward and the soft grade pay it
    ("<think>work</think>\n<answer>{wrong}</answer>", 0.0, False),  # wrong
    ("<answer>unsure</answer>", 0.0, False),  # malformed: no answer in the tag
    ("I am not sure.", 0.0, False),  # no answer at all
    ("", 0.0, False),  # nothing
)
HUB_RECORDS = {  # what the fake `datasets` package serves for the two hub tasks (GSM8K's test split, GSM-Hard)
    "openai/gsm8k": [{"question": f"Tom has {i} bags of 3 apples. How many apples?", "answer": f"{i} * 3\n#### {3 * i}"}
                     for i in range(1, 7)],
    "reasoning-machines/gsm-hard": [{"input": f"What is {i} * 1234567?", "target": float(i * 1234567)}
                                    for i in range(1, 7)],
}
BUILTIN_TASKS = ("arithmetic", "gsm8k", "gsm8k-mock", "gsm-hard", "reasoning-gym:chain_sum")


def _canned_evaluation(model, tokenizer, rows, completions, monkeypatch):
    """`evaluate` on rows, with the model's completions replaced by `completions` (one per row)."""
    from forge.core.rollout import generate as real_generate

    evaluate_module = sys.modules["forge.eval.evaluate"]  # forge.eval.evaluate the attribute is the function

    def canned_generate(model, tokenizer, prompts, num_samples, settings, **kwargs):
        rollout = real_generate(model, tokenizer, prompts, num_samples, settings, **kwargs)
        rollout.completions[:] = completions[: len(prompts)]
        return rollout

    monkeypatch.setattr(evaluate_module, "generate", canned_generate)
    return evaluate(model, tokenizer, rows, max_new_tokens=2)


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_each_tasks_reward_pays_what_its_evaluation_counts_as_right(name, tiny_model, tiny_tokenizer, monkeypatch):
    if name.startswith("reasoning-gym:"):
        pytest.importorskip("reasoning_gym")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(
        load_dataset=lambda dataset_id, config=None, split="train": HUB_RECORDS[dataset_id]))
    task = task_for(name)
    rows = task.heldout(n=len(TABLE), chat=True)
    assert len(rows) == len(TABLE)
    completions = [text.format(ref=row["reference"], wrong=int(float(row["reference"])) + 1)
                   for (text, _, _), row in zip(TABLE, rows)]
    prompts = [row["prompt"] for row in rows]

    reward = as_reward(task.reward)  # as GRPOTrainer takes it
    scores = reward(prompts, completions, **reward_kwargs(rows)).scores
    assert scores == [expected for _, expected, _ in TABLE]
    assert reward.name == ("reasoning_gym" if name.startswith("reasoning-gym:") else "math_correctness")
    for completion, row, score in zip(completions, rows, scores):  # the reward is the task's grade of the answer
        columns = {key: value for key, value in row.items() if key not in ("prompt", "reference")}
        assert task.grade(extract_final_answer(completion), row["reference"], **columns) == score

    result = _canned_evaluation(tiny_model, tiny_tokenizer, rows, completions, monkeypatch)
    assert [record["soft"][0] for record in result.records] == [score == 1.0 for score in scores]
    assert [record["strict"][0] for record in result.records] == [strict for _, _, strict in TABLE]
    assert [record["statuses"][0] for record in result.records][:3] == [CORRECT, NO_ANSWER, WRONG_ANSWER]
    if "task_score" in result.metrics:  # reasoning-gym: the evaluation's score is the reward itself
        assert [record["task_scores"][0] for record in result.records] == scores
    else:  # the math tasks: the core reward of the same name pays the same
        assert MathCorrectnessReward()(prompts, completions, **reward_kwargs(rows)).scores == scores


def test_the_task_table_names_every_builtin_dataset(tiny_tokenizer):
    assert list(TASK_TABLE) == ["gsm8k", "gsm8k-mock", "gsm-hard", "arithmetic", "reasoning-gym"]
    assert all(task_for(name) is task for name, task in TASK_TABLE.items() if name != "reasoning-gym")
    assert BUILTIN_DATASETS["arithmetic"] is TASK_TABLE["arithmetic"].rows
    assert task_for("reasoning-gym:chain_sum:max_terms=2").name == "reasoning-gym:chain_sum:max_terms=2"
    assert task_for("rows.jsonl") is None and task_for("hf:a/b") is None and task_for([{"prompt": "x"}]) is None
    assert [row["reference"] for row in task_for("gsm8k-mock").heldout(n=3)] == [a for _, a in GSM8K_MOCK_PROBLEMS[:3]]
    assert len(task_for("arithmetic").heldout()) == 60 and len(task_for("gsm8k-mock").heldout()) == 20


def test_forge_train_rewards_a_builtin_task_with_its_own_reward_unless_told_otherwise():
    from forge.cli import _rewards_for, build_parser

    parse = build_parser().parse_args
    for name in ("arithmetic", "gsm8k-mock"):
        rewards, weights = _rewards_for(parse(["train", "--dataset", name]))
        assert rewards[0] is TASK_TABLE[name].reward and isinstance(rewards[1], TagFormatReward)
        assert weights == [1.0, 0.1]
    rewards, _ = _rewards_for(parse(["train", "--dataset", "arithmetic", "--reward", "math_correctness"]))
    assert isinstance(rewards[0], MathCorrectnessReward)  # named by the user: that reward
    rewards, _ = _rewards_for(parse(["train", "--dataset", "rows.jsonl"]))
    assert isinstance(rewards[0], MathCorrectnessReward)  # not a built-in task: the default reward


# ----------------------------------------------------------------------------------------------------------
# reasoning-gym

rg = pytest.importorskip("reasoning_gym")
from forge.data import reasoning_gym_tasks as rgt

TASKS = ("basic_arithmetic", "chain_sum", "leg_counting")  # expressions with / and (), sums, a word problem


def _reward_kwargs(rows):
    return reward_kwargs(rows)


@pytest.mark.parametrize("task", TASKS)
def test_reasoning_gym_rows_come_from_create_dataset_with_chat_prompts(task):
    rows = rgt.reasoning_gym_dataset(task, size=12, seed=3)
    validate_rows(rows)
    entries = [rg.create_dataset(task, size=40, seed=3)[index] for index in range(40)]
    questions = [entry["question"] for entry in entries]
    for row in rows:
        assert row["question"] in questions  # drawn from the task's own generator and seed
        entry = entries[questions.index(row["question"])]
        assert row["rg_entry"]["answer"] == row["reference"] == entry["answer"]
        assert row["rg_task"] == task and json.loads(row["rg_config"]) == {}
        messages = row["prompt"]
        assert messages[0]["role"] == "system" and "<answer>" in messages[0]["content"]
        assert messages[-1] == {"role": "user", "content": row["question"]}
        assert messages[2]["content"].startswith("<answer>")  # one solved example shows the answer format
    assert rgt.reasoning_gym_dataset(task, size=12, seed=3) == rows  # deterministic
    assert isinstance(rgt.reasoning_gym_dataset(task, size=2, chat=False)[0]["prompt"], str)
    assert len(rgt.reasoning_gym_dataset(task, size=2, few_shot=False)[0]["prompt"]) == 2


@pytest.mark.parametrize("task", TASKS)
def test_heldout_rows_come_from_a_disjoint_seed_and_are_checked_disjoint(task):
    heldout = rgt.reasoning_gym_heldout(task, n=50)
    assert len(heldout) == 50
    pool = {row["question"] for row in rgt.reasoning_gym_heldout(task, n=rgt.HELDOUT_POOL_SIZE)}
    expected = [rg.create_dataset(task, size=50, seed=rgt.HELDOUT_SEED)[i]["question"] for i in range(50)]
    assert [row["question"] for row in heldout] == expected
    for seed in (0, 1, 7):
        train = rgt.reasoning_gym_dataset(task, size=100, seed=seed)
        assert len(train) == 100 and not pool & {row["question"] for row in train}


def test_a_training_seed_next_to_the_heldout_seed_skips_the_shared_problems():
    # reasoning-gym draws problem idx of seed s with Random(s + idx): seed HELDOUT_SEED + POOL - 10 repeats the
    # last 10 problems of the held-out pool; the question check skips each of them and draws more.
    seed = rgt.HELDOUT_SEED + rgt.HELDOUT_POOL_SIZE - 10
    train = rgt.reasoning_gym_dataset("chain_sum", size=20, seed=seed)
    pool = {row["question"] for row in rgt.reasoning_gym_heldout("chain_sum", n=rgt.HELDOUT_POOL_SIZE)}
    assert len(train) == 20 and not pool & {row["question"] for row in train}
    drawn = [rg.create_dataset("chain_sum", size=30, seed=seed)[i]["question"] for i in range(30)]
    assert [row["question"] for row in train] == [q for q in drawn if q not in pool][:20]
    assert sum(q in pool for q in drawn[:10]) == 10
    with pytest.raises(ValueError, match="held-out seed"):
        rgt.reasoning_gym_dataset("chain_sum", size=2, seed=rgt.HELDOUT_SEED)


def test_a_task_with_too_few_distinct_problems_says_so():
    tiny_config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    with pytest.raises(ValueError, match="disjoint from its held-out set"):
        rgt.reasoning_gym_dataset("chain_sum", size=400, config=tiny_config)  # ~200 distinct sums


@pytest.mark.parametrize("task", TASKS)
def test_the_reward_is_the_tasks_own_score_answer(task):
    rows = rgt.reasoning_gym_dataset(task, size=6, seed=1)
    dataset = rg.create_dataset(task, size=1, seed=0)
    responses = [
        f"<think>...</think><answer>{rows[0]['reference']}</answer>",  # right
        "<answer>wrong</answer>",  # wrong
        f"<answer>{rows[2]['reference']} legs</answer>",  # the oracle inside a longer answer: partial credit
        "no answer at all",
        f"The answer is {rows[4]['reference']}",  # soft: the last number
        "",
    ]
    reward = rgt.ReasoningGymReward()
    scores = call_with_accepted_kwargs(reward, [row["prompt"] for row in rows], responses, _reward_kwargs(rows))
    extracted = [reward.extract(response) for response in responses]
    expected = [0.0 if answer is None else float(dataset.score_answer(answer, row["rg_entry"]))
                for answer, row in zip(extracted, rows)]
    assert scores == expected
    assert scores[0] == 1.0 and scores[1] == 0.0 and 0.0 < scores[2] < 1.0
    assert scores[5] == 0.0
    strict = call_with_accepted_kwargs(rgt.ReasoningGymReward(strict=True), [r["prompt"] for r in rows], responses,
                                       _reward_kwargs(rows))
    assert strict[4] == 0.0 and strict[0] == 1.0  # no <answer> tag, no strict credit
    assert reward.name == "reasoning_gym"


@pytest.mark.parametrize("task", TASKS)
def test_evaluation_grades_with_the_same_scorer_as_the_reward(task, tiny_model, tiny_tokenizer, monkeypatch):
    rows = rgt.reasoning_gym_heldout(task, n=4, few_shot=False)
    canned = [f"<answer>{rows[0]['reference']}</answer>", f"<answer>{rows[1]['reference']}0</answer>",
              f"It is {rows[2]['reference']}", "nothing"]

    from forge.core.rollout import generate as real_generate

    evaluate_module = sys.modules["forge.eval.evaluate"]  # forge.eval.evaluate the attribute is the function

    def canned_generate(model, tokenizer, prompts, num_samples, settings, **kwargs):
        rollout = real_generate(model, tokenizer, prompts, num_samples, settings, **kwargs)
        rollout.completions[:] = canned[: len(prompts)]
        return rollout

    monkeypatch.setattr(evaluate_module, "generate", canned_generate)
    result = evaluate(tiny_model, tiny_tokenizer, rows, max_new_tokens=2)
    reward = call_with_accepted_kwargs(rgt.ReasoningGymReward(), [r["prompt"] for r in rows], canned,
                                       _reward_kwargs(rows))
    strict_reward = call_with_accepted_kwargs(rgt.ReasoningGymReward(strict=True), [r["prompt"] for r in rows],
                                              canned, _reward_kwargs(rows))
    assert [rec["task_scores"][0] for rec in result.records] == reward
    assert [rec["soft"][0] for rec in result.records] == [score == 1.0 for score in reward]
    assert [rec["strict"][0] for rec in result.records] == [score == 1.0 for score in strict_reward]
    assert result.records[0]["strict"] == [True] and result.records[2]["strict"] == [False]
    assert result.records[2]["soft"] == [True] and result.records[3]["statuses"] == ["NO ANSWER EXTRACTED"]
    assert result.metrics["task_score"] == pytest.approx(sum(reward) / 4)


def test_reasoning_gym_names_load_through_load_rows_and_the_eval_loader():
    assert len(load_rows("reasoning-gym:chain_sum", n=5)) == 5
    assert load_rows("reasoning-gym:chain_sum@heldout", n=3) == rgt.reasoning_gym_heldout("chain_sum", n=3)
    assert load_eval_rows("reasoning-gym:leg_counting", n=3) == rgt.reasoning_gym_heldout("leg_counting", n=3)
    assert len(load_eval_rows("reasoning-gym:leg_counting")) == 50
    assert rgt.parse_reasoning_gym_spec("reasoning-gym:x@test") == ("x", {}, "heldout")
    assert rgt.parse_reasoning_gym_spec("reasoning-gym:chain_sum:max_terms=2, max_digits=2,allow_negation=True") == (
        "chain_sum", {"max_terms": 2, "max_digits": 2, "allow_negation": True}, "train")
    easy = load_eval_rows("reasoning-gym:chain_sum:max_terms=2,max_digits=1", n=5)
    assert easy == rgt.reasoning_gym_heldout("chain_sum", n=5, config={"max_terms": 2, "max_digits": 1})
    assert all(row["question"].count(" + ") + row["question"].count(" - ") == 1 for row in easy)
    assert json.loads(easy[0]["rg_config"]) == {"max_digits": 1, "max_terms": 2}
    with pytest.raises(ValueError, match="no_such_key"):
        load_rows("reasoning-gym:chain_sum:no_such_key=1", n=2)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_rows("reasoning-gym:chain_sum:max_terms", n=2)
    assert source_kwargs("reasoning-gym:x", chat=True, heldout=True) == {"chat": True, "split": "heldout", "n": None}
    with pytest.raises(ValueError, match="'train' or 'heldout'"):
        rgt.parse_reasoning_gym_spec("reasoning-gym:chain_sum@dev")


def test_an_unknown_task_lists_close_matches():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym task 'chain_sums'; did you mean chain_sum"):
        load_rows("reasoning-gym:chain_sums")
    with pytest.raises(ValueError, match="leg_counting"):
        load_eval_rows("reasoning-gym:leg_count")
    with pytest.raises(ValueError, match="names no task"):
        load_rows("reasoning-gym:")


def test_a_scorer_that_raises_scores_zero(monkeypatch):
    row = rgt.reasoning_gym_dataset("chain_sum", size=1)[0]
    dataset = rgt._scorer_dataset("chain_sum", "{}")

    def broken(answer, entry):
        raise RuntimeError("boom")

    monkeypatch.setattr(dataset, "score_answer", broken)
    assert rgt.score_answer_for("5", "chain_sum", row["rg_entry"], "{}") == 0.0


def test_reasoning_gym_missing_is_an_import_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r"forge-rl\[reasoning-gym\]"):
        rgt.available_tasks()


def test_grpo_trains_on_a_reasoning_gym_task_with_its_own_reward(tiny_model, tiny_tokenizer, tmp_path):
    from forge.core.config import GRPOConfig
    from forge.core.trainer import GRPOTrainer

    rows = rgt.reasoning_gym_dataset("chain_sum", size=4, few_shot=False)
    config = GRPOConfig(group_size=2, max_new_tokens=4, max_steps=1, gradient_accumulation_steps=1,
                        logging_steps=1, save_steps=0, output_dir=str(tmp_path / "run"), kl_beta=0.0,
                        eval_before_training=True)
    from forge.eval.evaluate import heldout_metrics

    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, [rgt.ReasoningGymReward(), TagFormatReward()], config,
                          evaluator=heldout_metrics)
    trainer.train(rows, eval_dataset=rgt.reasoning_gym_heldout("chain_sum", n=2, few_shot=False))
    log = [json.loads(line) for line in (tmp_path / "run" / "training_log.jsonl").read_text().splitlines()]
    assert any("rewards/reasoning_gym/mean" in row for row in log)
    assert any("eval_task_score" in row for row in log)


# ----------------------------------------------------------------------------------------------------------
# the command line with reasoning-gym


def test_forge_eval_on_a_reasoning_gym_task(model_folder, tmp_path, capsys):
    from forge.cli import main

    assert main(["eval", "--model", str(model_folder), "--data", "reasoning-gym:leg_counting", "--n", "2",
                 "--max_new_tokens", "3", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    metrics = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    assert metrics["n"] == 2 and "task_score" in metrics
    assert "chat template" in captured.err


def test_forge_train_on_a_reasoning_gym_task_uses_its_scorer(model_folder, tmp_path, capsys):
    from forge.cli import main

    out = tmp_path / "run"
    assert main(["train", "--model", str(model_folder), "--dataset", "reasoning-gym:chain_sum", "--max_samples", "4",
                 "--eval_dataset", "reasoning-gym:chain_sum", "--group_size", "2", "--max_new_tokens", "4",
                 "--max_steps", "1", "--logging_steps", "1", "--save_steps", "0", "--eval_steps", "1",
                 "--output_dir", str(out)]) == 0
    assert "ReasoningGymReward" in capsys.readouterr().err
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert any("rewards/reasoning_gym/mean" in row for row in log) and any("eval_task_score" in row for row in log)


# ----------------------------------------------------------------------------------------------------------
# hf: datasets

datasets = pytest.importorskip("datasets")
from forge.data.hf_dataset import parse_hf_spec, rows_from_records

RECORDS = {"question": ["What is 2 + 3?", "What is 10 - 4?", "Name a prime."],
           "answer": ["Add them.\n#### 5", "#### 6", "7"], "id": [1, 2, 3]}


def test_hf_spec_parsing():
    assert parse_hf_spec("hf:openai/gsm8k") == ("openai/gsm8k", None, None)
    assert parse_hf_spec("hf:openai/gsm8k:main@test") == ("openai/gsm8k", "main", "test")
    assert parse_hf_spec("hf:org/name@validation") == ("org/name", None, "validation")
    assert parse_hf_spec("hf:/tmp/data/set") == ("/tmp/data/set", None, None)
    with pytest.raises(ValueError, match="names no dataset"):
        parse_hf_spec("hf:")


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(RECORDS),
                          "test": datasets.Dataset.from_dict({k: v[:1] for k, v in RECORDS.items()})}
                         ).save_to_disk(str(tmp_path / "set"))
    rows = load_rows(f"hf:{tmp_path / 'set'}")
    assert [row["reference"] for row in rows] == ["5", "6", "7"]  # GSM8K-style "#### N" -> N
    assert rows[0] == {"prompt": "What is 2 + 3?", "reference": "5", "question": "What is 2 + 3?"}
    chat = load_rows(f"hf:{tmp_path / 'set'}@test", chat=True)
    assert len(chat) == 1 and chat[0]["prompt"][0]["role"] == "system" and "<answer>" in chat[0]["prompt"][0]["content"]
    assert chat[0]["prompt"][1] == {"role": "user", "content": "What is 2 + 3?"}
    assert detect_answer_format(chat[0]["prompt"]) == "tag"
    assert len(load_eval_rows(f"hf:{tmp_path / 'set'}", split="train", n=2)) == 2
    with pytest.raises(ValueError, match="splits"):
        load_rows(f"hf:{tmp_path / 'set'}@validation")
    single = tmp_path / "single"
    datasets.Dataset.from_dict(RECORDS).save_to_disk(str(single))
    assert len(load_rows(f"hf:{single}", prompt_column="question", reference_column="id")) == 3


def test_hf_parquet_file_and_json_folder(tmp_path):
    datasets.Dataset.from_dict({"problem": RECORDS["question"], "solution": RECORDS["answer"]}).to_parquet(
        str(tmp_path / "data.parquet"))
    rows = load_rows(f"hf:{tmp_path / 'data.parquet'}", prompt_column="problem", reference_column="solution")
    assert [row["question"] for row in rows] == RECORDS["question"]
    folder = tmp_path / "json_set"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                for q, a in zip(RECORDS["question"], RECORDS["answer"])))
    assert len(load_rows(f"hf:{folder}")) == 3  # datasets.load_dataset on a local folder (the hub code path)


def test_hf_missing_column_names_the_columns_that_exist(tmp_path):
    datasets.Dataset.from_dict(RECORDS).save_to_disk(str(tmp_path / "set"))
    with pytest.raises(ValueError, match=r"no column 'problem'; its columns are \['question', 'answer', 'id'\]"):
        load_rows(f"hf:{tmp_path / 'set'}", prompt_column="problem")


def test_hf_zero_usable_rows_says_why(tmp_path):
    records = {"question": ["", "  ", "Q?"], "answer": ["1", "2", None]}
    datasets.Dataset.from_dict(records).save_to_disk(str(tmp_path / "set"))
    with pytest.raises(ValueError, match=r"zero usable rows: of its 3 rows, 2 have an empty .*'question' and 1 have "
                                         r"no 'answer'"):
        load_rows(f"hf:{tmp_path / 'set'}")
    with pytest.raises(ValueError, match="zero usable rows: it has no rows"):
        rows_from_records([], "question", "answer")


def test_hf_chat_message_prompts_pass_through():
    records = [{"messages": [{"role": "user", "content": "Hi?"}], "answer": "1"}]
    rows = rows_from_records(records, "messages", "answer", chat=True)
    assert rows[0]["prompt"] == [{"role": "user", "content": "Hi?"}] and rows[0]["question"] == "Hi?"


def test_forge_train_and_eval_on_an_hf_dataset(model_folder, tmp_path):
    from forge.cli import main

    datasets.Dataset.from_dict({"problem": RECORDS["question"], "solution": RECORDS["answer"]}).save_to_disk(
        str(tmp_path / "set"))
    common = ["--prompt_column", "problem", "--reference_column", "solution", "--chat", "false"]
    assert main(["train", "--model", str(model_folder), "--dataset", f"hf:{tmp_path / 'set'}", *common,
                 "--reward", "math_correctness", "--group_size", "2", "--max_new_tokens", "4", "--max_steps", "1",
                 "--logging_steps", "1", "--save_steps", "0", "--output_dir", str(tmp_path / "run")]) == 0
    assert main(["eval", "--model", str(model_folder), "--data", f"hf:{tmp_path / 'set'}", *common,
                 "--max_new_tokens", "3", "--out", str(tmp_path / "eval")]) == 0
    records = json.loads((tmp_path / "eval" / "eval.json").read_text())["records"]
    assert [r["reference"] for r in records] == ["5", "6", "7"] and isinstance(records[0]["prompt"], str)
