"""Evaluation: pass@k and majority vote by hand, the grading table, evaluate/compare/screen on the tiny model."""

import importlib
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from forge.eval.evaluate import EvalResult, evaluate, evaluate_model, load_eval_rows
from forge.eval.metrics import (
    CORRECT,
    NO_ANSWER,
    UNPARSEABLE,
    WRONG_ANSWER,
    detect_answer_format,
    grade,
    majority_vote,
    pass_at_k,
)
from forge.eval.report import build_comparison, compare, write_comparison
from forge.eval.screen import screen_prompts

# the package exports the function `evaluate`, which hides the module of the same name from attribute access
evaluate_module = importlib.import_module("forge.eval.evaluate")

# --------------------------------------------------------------------------------------------------
# pass@k: 1 - C(n-c, k) / C(n, k)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),  # = c / n
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
        (5, 2, 3, 1 - 1 / 10),  # C(3,3)=1, C(5,3)=10
        (5, 2, 4, 1.0),  # n - c = 3 < k: every 4-subset holds a correct sample
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 5, 1, 1.0),
        (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # the binomials here overflow a float; the product form does not
    n, c, k = 2000, 7, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python ints are exact
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("n, c, k", [(5, 2, 6), (5, 2, 0), (5, 6, 1), (0, 0, 1), (5, -1, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# --------------------------------------------------------------------------------------------------
# majority vote


@pytest.mark.parametrize(
    "answers, expected",
    [
        (["3", "4", "4"], "4"),
        (["1,000", "7", "1000", "7.0", "$1000"], "1,000"),  # numbers grouped by value; first spelling kept
        (["5", "6"], "5"),  # tie -> the earliest
        (["6", "5", "5", "6"], "6"),  # tie of groups -> the one seen first
        ([None, None, "2"], "2"),
        ([None, "9", None, "8", "8"], "8"),
        ([None, None], None),
        ([], None),
        (["x + 1", "x + 1", "3"], "x + 1"),
    ],
)
def test_majority_vote(answers, expected):
    assert majority_vote(answers) == expected


# --------------------------------------------------------------------------------------------------
# grading: strict (answer in the required place) vs soft (final answer anywhere)

_TAG_TABLE = [
    # response, strict_correct, soft_correct, format_ok, status
    ("<think>6 times 7</think><answer>42</answer>", True, True, True, CORRECT),
    ("<answer> 42 </answer>", True, True, True, CORRECT),
    ("<answer>42.0</answer>", True, True, True, CORRECT),
    ("<answer>$42</answer>", True, True, True, CORRECT),
    ("the answer is 42", False, True, False, NO_ANSWER),
    ("Answer: 42", False, True, False, NO_ANSWER),
    ("<answer>41</answer> ... actually 42", False, False, True, WRONG_ANSWER),  # the tag wins
    ("<think>42</think><answer>41</answer>", False, False, True, WRONG_ANSWER),
    ("<answer>42", False, True, False, NO_ANSWER),  # never closed: soft reads it, strict does not
    ("<ANSWER>42</ANSWER>", False, True, False, NO_ANSWER),  # strict tag names are exact
    ("<answer>forty two</answer>", False, False, True, UNPARSEABLE),
    ("<answer></answer> 42", False, True, False, NO_ANSWER),
    ("", False, False, False, NO_ANSWER),
    ("I don't know", False, False, False, NO_ANSWER),
]

_LINE_TABLE = [
    ("6 times 7 is 42.\nAnswer: 42", True, True, True, CORRECT),
    ("Answer: 42", True, True, True, CORRECT),
    ("**Answer:** 42", True, True, True, CORRECT),
    ("Final answer: 42", True, True, True, CORRECT),
    ("Answer: 1,000", False, False, True, WRONG_ANSWER),
    ("Answer: 41\nsorry, I mean 42", False, False, True, WRONG_ANSWER),  # the Answer: line is the answer
    ("Answer: 41\nAnswer: 42", True, True, True, CORRECT),  # the last line counts
    ("the answer is 42", False, True, False, NO_ANSWER),
    ("So the answer: 42", True, True, True, CORRECT),  # the shared GSM8K reading of "Answer:"
    ("Answer:\n42", True, True, True, CORRECT),
    ("<answer>42</answer>", False, True, False, NO_ANSWER),
    ("Answer: unknown", False, False, True, UNPARSEABLE),
    ("", False, False, False, NO_ANSWER),
]


@pytest.mark.parametrize("response, strict, soft, format_ok, status", _TAG_TABLE)
def test_grade_tag_format(response, strict, soft, format_ok, status):
    result = grade(response, "42", "tag")
    assert (result.strict_correct, result.soft_correct, result.format_ok, result.status) == (
        strict, soft, format_ok, status)


@pytest.mark.parametrize("response, strict, soft, format_ok, status", _LINE_TABLE)
def test_grade_answer_line_format(response, strict, soft, format_ok, status):
    result = grade(response, "42", "answer_line")
    assert (result.strict_correct, result.soft_correct, result.format_ok, result.status) == (
        strict, soft, format_ok, status)


def test_grade_reports_both_answers_and_reads_gsm8k_references():
    result = grade("<answer>41</answer> no wait, 42", "Six times seven.\n#### 42", "tag")
    assert (result.answer, result.soft_answer) == ("41", "41")
    assert grade("<answer>42</answer>", "Six times seven.\n#### 42", "tag").strict_correct
    assert grade("<answer>42</answer>", 42, "tag").strict_correct  # numeric references are fine too


def test_grade_rejects_unknown_format():
    with pytest.raises(ValueError, match="answer_format"):
        grade("42", "42", "boxed")


def test_grade_matches_the_training_rewards():
    """The eval grader and the correctness reward are the same code: soft == MathCorrectnessReward(),
    strict (tag prompts) == MathCorrectnessReward(strict=True)."""
    from forge.core.reward import MathCorrectnessReward

    responses = [row[0] for row in _TAG_TABLE]
    references = ["42"] * len(responses)
    soft_scores = MathCorrectnessReward()(["q"] * len(responses), responses, references=references).scores
    strict_scores = MathCorrectnessReward(strict=True)(["q"] * len(responses), responses,
                                                       references=references).scores
    grades = [grade(response, "42", "tag") for response in responses]
    assert [float(g.soft_correct) for g in grades] == soft_scores
    assert [float(g.strict_correct) for g in grades] == strict_scores


def test_detect_answer_format():
    assert detect_answer_format("Put the result in <answer></answer> tags.") == "tag"
    assert detect_answer_format("End with a line 'Answer: <number>'.") == "answer_line"
    chat = [{"role": "system", "content": "Reply as <think>...</think><answer>...</answer>"},
            {"role": "user", "content": "What is 2 + 2?"}]
    assert detect_answer_format(chat) == "tag"
    assert detect_answer_format([{"role": "user", "content": "What is 2 + 2?"}]) == "answer_line"


# --------------------------------------------------------------------------------------------------
# evaluate: a fake generator for exact numbers, the tiny model for the real path


TAG_PROMPT = "Reply with <think>...</think><answer>...</answer>. "
ROWS = [
    {"prompt": TAG_PROMPT + "What is 2 + 3?", "reference": "5"},
    {"prompt": TAG_PROMPT + "What is 4 * 4?", "reference": "16"},
    {"prompt": "What is 10 - 7? End with 'Answer: <number>'.", "reference": "3"},
]


def fake_generator(script: dict[str, list[str]]):
    """A stand-in for rollout.generate: the completions for each prompt come from `script` (by prompt text,
    or by (model, prompt) when the script is keyed that way)."""
    def fake_generate(model, tokenizer, prompts, group_size, settings, **kwargs):
        completions = []
        for prompt in prompts:
            group = script.get((id(model), prompt), script.get(prompt))
            assert len(group) == group_size
            completions += group
        lengths = torch.tensor([len(text.split()) for text in completions])
        return SimpleNamespace(completions=completions, completion_lengths=lengths,
                               truncated=torch.zeros(len(completions), dtype=torch.bool))
    return fake_generate


def test_evaluate_metrics_by_hand(tiny_model, tiny_tokenizer, monkeypatch):
    script = {
        ROWS[0]["prompt"]: ["<think>2+3</think><answer>5</answer>", "the answer is 5",  # strict, soft only
                            "<answer>6</answer>", "<answer>5</answer>"],  # wrong, strict
        ROWS[1]["prompt"]: ["<answer>15</answer>", "<answer>16</answer>", "16", "<answer>15</answer>"],
        ROWS[2]["prompt"]: ["Answer: 3", "Answer: 4", "Answer: 4", "so 3"],
    }
    monkeypatch.setattr(evaluate_module, "generate", fake_generator(script))
    result = evaluate(tiny_model, tiny_tokenizer, ROWS, num_samples=4, temperature=1.0, k_values=(1, 2, 4),
                      batch_size=2)
    m = result.metrics
    # strict: [1,0,0,1] [0,1,0,0] [1,0,0,0] -> 4/12; soft adds "the answer is 5", "16", "so 3" -> 7/12
    assert m["strict_accuracy"] == pytest.approx(4 / 12)
    assert m["soft_accuracy"] == pytest.approx(7 / 12)
    assert m["format_rate"] == pytest.approx(9 / 12)  # 3 tag answers missing ("the answer is 5", "16", "so 3")
    assert m["n"] == 3 and m["num_samples"] == 4
    assert m["pass@1"] == pytest.approx(m["strict_accuracy"])  # equal group sizes: pass@1 = mean accuracy
    assert m["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2) + pass_at_k(4, 1, 2)) / 3)
    assert m["pass@4"] == pytest.approx(1.0)
    # maj@4 over strict answers: {5,6,5} -> 5 right; {15,16,15} -> 15 wrong; {3,4,4} -> 4 wrong
    assert m["maj@4"] == pytest.approx(1 / 3)
    assert m["maj@2"] == pytest.approx(2 / 3)  # first two: {5}, {15,16} -> 15, {3,4} -> 3
    # soft answers: {5,5,6,5} -> 5 right; {15,16,16,15} tie -> 15 (seen first) wrong; {3,4,4,3} tie -> 3 right
    assert m["soft_maj@4"] == pytest.approx(2 / 3)
    record = result.records[1]
    assert record["statuses"] == [WRONG_ANSWER, CORRECT, NO_ANSWER, WRONG_ANSWER]
    assert record["num_strict_correct"] == 1 and record["num_soft_correct"] == 2
    assert [r["answer_format"] for r in result.records] == ["tag", "tag", "answer_line"]


def test_evaluate_on_tiny_model_returns_full_records(tiny_model, tiny_tokenizer):
    tiny_model.train()
    rng_before = torch.get_rng_state()
    result = evaluate(tiny_model, tiny_tokenizer, ROWS, max_new_tokens=6, batch_size=2)
    assert isinstance(result, EvalResult)
    assert result.metrics["n"] == 3 and len(result.records) == 3
    for key in ("strict_accuracy", "soft_accuracy", "format_rate", "mean_completion_length", "frac_truncated",
                "seconds"):
        assert key in result.metrics
    assert not any(key.startswith("pass@") for key in result.metrics)  # one greedy sample: no pass@k
    for index, record in enumerate(result.records):
        assert record["index"] == index and record["reference"] == ROWS[index]["reference"]
        assert record["prompt"] == ROWS[index]["prompt"] and record["question"] == ROWS[index]["prompt"]
        for key in ("responses", "answers", "soft_answers", "statuses", "strict", "soft", "format_ok",
                    "completion_lengths", "truncated"):
            assert len(record[key]) == 1, key
        assert 1 <= record["completion_lengths"][0] <= 6
    assert tiny_model.training  # mode restored
    assert torch.equal(torch.get_rng_state(), rng_before)  # evaluation leaves the training RNG alone
    again = evaluate(tiny_model, tiny_tokenizer, ROWS, max_new_tokens=6, batch_size=3)
    assert [r["responses"] for r in again.records] == [r["responses"] for r in result.records]  # greedy
    json.dumps(result.to_dict())  # JSON-ready


def test_evaluate_sampling_and_chat_prompts_on_tiny_model(tiny_model, tiny_tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reference": "2", "kind": "add"}]
    first = evaluate(tiny_model, tiny_tokenizer, rows, max_new_tokens=5, num_samples=3, temperature=1.0,
                     k_values=(1, 3), seed=7)
    second = evaluate(tiny_model, tiny_tokenizer, rows, max_new_tokens=5, num_samples=3, temperature=1.0,
                      k_values=(1, 3), seed=7)
    assert first.records[0]["responses"] == second.records[0]["responses"]  # seeded
    assert len(first.records[0]["responses"]) == 3
    assert {"pass@1", "pass@3", "maj@1", "maj@3"} <= set(first.metrics)
    assert first.records[0]["question"] == "What is 1 + 1?" and first.records[0]["fields"] == {"kind": "add"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_samples": 4}, "temperature"),  # several greedy samples would be identical
        ({"num_samples": 2, "temperature": 1.0, "k_values": (4,)}, "k"),
        ({"answer_format": "boxed"}, "answer_format"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_evaluate_rejects_bad_settings(tiny_model, tiny_tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        evaluate(tiny_model, tiny_tokenizer, ROWS, max_new_tokens=2, **kwargs)


def test_evaluate_needs_references(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="reference"):
        evaluate(tiny_model, tiny_tokenizer, [{"prompt": "hi"}], max_new_tokens=2)


def test_references_the_math_grader_cannot_read_are_warned_about(tiny_model, tiny_tokenizer):
    from forge.eval.evaluate import heldout_metrics

    words = [{"prompt": f"Capital of {c}?", "reference": city} for c, city in [("France", "Paris"), ("Peru", "Lima"),
                                                                              ("Chad", "N'Djamena"), ("Fiji", "12")]]
    for evaluator in (evaluate, heldout_metrics):
        with pytest.warns(UserWarning, match=r"3 of 4 references are not numbers or math the grader reads \(e\.g\. "
                                             r"row 0: 'Paris'\).*forge eval --reward"):
            evaluator(tiny_model, tiny_tokenizer, words, max_new_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numbers and math: no warning
        evaluate(tiny_model, tiny_tokenizer, [*words[3:] * 2, {"prompt": "x?", "reference": "\\frac{1}{2}"}],
                 max_new_tokens=2)


def test_evaluate_model_with_rewards_adds_their_mean_on_greedy_completions(tiny_model, tiny_tokenizer):
    def length(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    rows = [{"prompt": "Say hi", "reference": "hi"}, {"prompt": "Say yo", "reference": "yo"}]
    with pytest.warns(UserWarning, match="references are not numbers"):
        result = evaluate_model((tiny_model, tiny_tokenizer), data=rows, max_new_tokens=3, rewards=[length],
                                reward_weights=[0.5])
    texts = [record["responses"][0] for record in result.records]  # evaluate's greedy completions: the same ones
    assert result.metrics["rewards/length/mean"] == pytest.approx(sum(map(len, texts)) / 2)
    assert result.metrics["reward"] == pytest.approx(0.5 * result.metrics["rewards/length/mean"])


def test_load_eval_rows_by_name(tmp_path):
    assert len(load_eval_rows("arithmetic", n=7)) == 7
    assert len(load_eval_rows("arithmetic")) == 60
    mock = load_eval_rows("gsm8k-mock", n=5)
    assert len(mock) == 5 and detect_answer_format(mock[0]["prompt"]) == "answer_line"
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    assert load_eval_rows(str(path), n=2) == ROWS[:2]


def test_evaluate_model_accepts_a_loaded_pair(tiny_model, tiny_tokenizer):
    result = evaluate_model((tiny_model, tiny_tokenizer), data="gsm8k-mock", n=2, max_new_tokens=3)
    assert result.metrics["n"] == 2 and result.records[0]["question"]


# --------------------------------------------------------------------------------------------------
# before/after comparison


def test_comparison_orders_fixed_broken_changed_identical(tiny_model, tiny_tokenizer, monkeypatch, tmp_path):
    from forge.model.tiny import build_tiny_model

    after_model, _ = build_tiny_model(tiny_tokenizer, seed=1)
    before_id, after_id = id(tiny_model), id(after_model)
    rows = ROWS + [{"prompt": TAG_PROMPT + "What is 9 - 9?", "reference": "0"}]
    script = {
        (before_id, rows[0]["prompt"]): ["<answer>5</answer>"], (after_id, rows[0]["prompt"]): ["<answer>5</answer>"],
        (before_id, rows[1]["prompt"]): ["<answer>16</answer>"], (after_id, rows[1]["prompt"]): ["16, I think"],
        (before_id, rows[2]["prompt"]): ["maybe 4"], (after_id, rows[2]["prompt"]): ["Answer: 3"],
        (before_id, rows[3]["prompt"]): ["<answer>1</answer>"], (after_id, rows[3]["prompt"]): ["<answer>2</answer>"],
    }
    monkeypatch.setattr(evaluate_module, "generate", fake_generator(script))
    report = compare(tiny_model, after_model, tiny_tokenizer, rows, labels=("base", "trained"), max_new_tokens=4)
    assert [(p["index"], p["change"]) for p in report.problems] == [
        (2, "fixed"), (1, "broken"), (3, "changed"), (0, "identical")]
    assert [p["same_text"] for p in report.problems] == [False, False, False, True]
    assert report.counts == {"fixed": 1, "broken": 1, "changed": 1, "identical": 1}
    broken = report.problems[1]
    assert broken["before"]["rewards"][0] == {"math_correctness": 1.0, "tag_format": 0.5}
    assert broken["after"]["rewards"][0] == {"math_correctness": 1.0, "tag_format": 0.0}  # soft right, no tags
    assert broken["after"]["statuses"] == [NO_ANSWER]
    assert report.problems[0]["before"]["rewards"][0] == {"math_correctness": 0.0}  # answer-line prompt: no tags
    strict = next(row for row in report.summary if row["metric"] == "strict_accuracy")
    assert (strict["before"], strict["after"]) == (0.5, 0.5)
    soft = next(row for row in report.summary if row["metric"] == "soft_accuracy")
    assert soft["change"] == pytest.approx(0.25)

    json_path, md_path = write_comparison(report, tmp_path / "report")
    data = json.loads(json_path.read_text())
    assert set(data) >= {"labels", "summary", "counts", "problems", "metrics", "settings"}
    for problem in data["problems"]:
        assert set(problem) >= {"question", "reference", "change", "same_text", "before", "after"}
        for side in ("before", "after"):
            assert set(problem[side]) >= {"responses", "answers", "statuses", "strict", "soft", "rewards"}
    markdown = md_path.read_text()
    assert markdown.index("## Summary") < markdown.index("## Fixed") < markdown.index("## Broken") \
        < markdown.index("## New text") < markdown.index("## Identical")
    assert "| metric | base | trained | change |" in markdown
    assert "| strict accuracy | 50.0% | 50.0% | +0.0 pts |" in markdown
    assert "| soft accuracy | 50.0% | 75.0% | +25.0 pts |" in markdown


def test_compare_on_tiny_models_writes_files(tiny_model, tiny_tokenizer, tmp_path):
    from forge.model.tiny import build_tiny_model

    other, _ = build_tiny_model(tiny_tokenizer, seed=3)
    report = compare(tiny_model, other, tiny_tokenizer, ROWS, max_new_tokens=4, num_samples=2, temperature=1.0,
                     k_values=(1, 2))
    assert {row["metric"] for row in report.summary} >= {"strict_accuracy", "soft_accuracy", "format_rate",
                                                        "pass@2", "maj@2"}
    json_path, md_path = write_comparison(report, tmp_path)
    assert json_path.is_file() and md_path.is_file()
    assert "sample 2/2" in md_path.read_text()


def test_build_comparison_refuses_different_problems(tiny_model, tiny_tokenizer):
    a = evaluate(tiny_model, tiny_tokenizer, ROWS[:2], max_new_tokens=2)
    b = evaluate(tiny_model, tiny_tokenizer, ROWS[1:], max_new_tokens=2)
    with pytest.raises(ValueError, match="same rows"):
        build_comparison(a, b)


# --------------------------------------------------------------------------------------------------
# screening training prompts


SCREEN_ROWS = [{"prompt": f"What is {i} + {i}? End with 'Answer: <number>'.", "reference": str(2 * i)}
               for i in range(5)]


def test_screen_keeps_exactly_the_mixed_groups(tiny_model, tiny_tokenizer):
    right, wrong = "Answer: {}", "Answer: -1"
    patterns = ["RRRR", "RWWW", "WWWW", "WRWR", "RRRW"]  # per candidate: which samples are right
    script = {row["prompt"]: [right.format(row["reference"]) if mark == "R" else wrong for mark in pattern]
              for row, pattern in zip(SCREEN_ROWS, patterns)}
    result = screen_prompts(tiny_model, tiny_tokenizer, SCREEN_ROWS, group_size=4, batch_size=2,
                            generate_fn=fake_generator(script))
    assert result.correct_counts == [4, 1, 0, 2, 3]
    assert result.kept == [SCREEN_ROWS[1], SCREEN_ROWS[3], SCREEN_ROWS[4]]
    assert (result.num_kept, result.num_all_correct, result.num_all_wrong, result.num_mixed) == (3, 1, 1, 3)
    assert "kept 3" in result.summary()
    json.dumps(result.report())

    unsolved = screen_prompts(tiny_model, tiny_tokenizer, SCREEN_ROWS, group_size=4, keep="unsolved",
                              generate_fn=fake_generator(script))
    assert unsolved.kept == SCREEN_ROWS[1:]


def test_screen_strict_grading_and_soft_grading_differ(tiny_model, tiny_tokenizer):
    row = {"prompt": TAG_PROMPT + "What is 3 + 3?", "reference": "6"}
    script = {row["prompt"]: ["<answer>6</answer>", "it is 6"]}
    soft = screen_prompts(tiny_model, tiny_tokenizer, [row], group_size=2, generate_fn=fake_generator(script))
    strict = screen_prompts(tiny_model, tiny_tokenizer, [row], group_size=2, correct_by="strict",
                            generate_fn=fake_generator(script))
    assert (soft.correct_counts, soft.num_kept) == ([2], 0)
    assert (strict.correct_counts, strict.num_kept) == ([1], 1)


def test_screen_refuses_heldout_rows(tiny_model, tiny_tokenizer):
    from forge.data.arithmetic import arithmetic_dataset, arithmetic_heldout

    heldout = arithmetic_heldout(n=10)
    with pytest.raises(ValueError, match="held-out"):
        screen_prompts(tiny_model, tiny_tokenizer, arithmetic_dataset(n=3) + heldout[4:5], heldout_rows=heldout,
                       generate_fn=fake_generator({}))
    plain = [{"prompt": "Question: " + question_row["prompt"][-1]["content"], "reference": "1"}
             for question_row in heldout[:1]]
    with pytest.raises(ValueError, match="held-out"):  # same question, other prompt wording: still refused
        screen_prompts(tiny_model, tiny_tokenizer, [{**plain[0], "question": heldout[0]["prompt"][-1]["content"]}],
                       heldout_rows=heldout, generate_fn=fake_generator({}))


def test_screen_on_tiny_model(tiny_model, tiny_tokenizer):
    result = screen_prompts(tiny_model, tiny_tokenizer, SCREEN_ROWS[:3], group_size=2, max_new_tokens=4)
    assert result.num_candidates == 3 and all(0 <= count <= 2 for count in result.correct_counts)
