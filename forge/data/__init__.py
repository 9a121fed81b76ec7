"""Tasks (GSM8K, GSM-Hard, a mock set, an arithmetic task, reasoning-gym): their rows, prompts and graders."""

from forge.data.answers import answers_match, extract_final_answer, extract_tagged_answer, parse_number
from forge.data.arithmetic import (
    SYSTEM_PROMPT,
    ArithmeticProblem,
    arithmetic_dataset,
    arithmetic_heldout,
    chat_prompt,
    generate_problems,
    heldout_problems,
    plain_prompt,
    train_problems,
)
from forge.data.dataset import (
    TASKS,
    builtin_dataset,
    is_chat,
    load_rows,
    task_for,
    validate_rows,
)
from forge.data.gsm8k import (
    extract_answer,
    few_shot_gsm8k_prompt,
    format_prompt,
    load_gsm8k,
    load_gsm8k_mock,
    load_gsm_hard,
    parse_gsm8k_answer,
)
from forge.data.task import Task

__all__ = [
    "SYSTEM_PROMPT",
    "TASKS",
    "ArithmeticProblem",
    "Task",
    "answers_match",
    "arithmetic_dataset",
    "arithmetic_heldout",
    "builtin_dataset",
    "chat_prompt",
    "extract_answer",
    "extract_final_answer",
    "extract_tagged_answer",
    "few_shot_gsm8k_prompt",
    "format_prompt",
    "generate_problems",
    "heldout_problems",
    "is_chat",
    "load_gsm8k",
    "load_gsm8k_mock",
    "load_gsm_hard",
    "load_rows",
    "parse_gsm8k_answer",
    "parse_number",
    "plain_prompt",
    "task_for",
    "train_problems",
    "validate_rows",
]
