"""The TRL name table (forge/core/trl_names.py) against the installed transformers and TRL: every field of
TrainingArguments and of TRL's GRPOConfig has one class (mapped, ignored, refused), what each class does to a
GRPOConfig, and docs/from-trl.md holding the table the code generates."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import transformers

from forge import GRPOConfig
from forge.core.config_docs import trl_tables_markdown
from forge.core.trl_fields import TRAINING_ARGUMENTS_FIELDS, TRL_GRPO_FIELDS
from forge.core.trl_names import TRL_CONVERTED, TRL_IGNORED, TRL_NAMES, TRL_REFUSED, classify

FORGE_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}
DEFAULT = GRPOConfig()


def default_of(field: dataclasses.Field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def unclassified(names) -> list[str]:
    return [name for name in names if classify(name, FORGE_FIELDS)[0] == "unclassified"]


def test_every_training_arguments_field_of_the_installed_transformers_is_classified():
    """Fails when transformers adds a TrainingArguments field: classify it in forge/core/trl_names.py, add it to
    TRAINING_ARGUMENTS_FIELDS, and regenerate the tables of docs/from-trl.md."""
    installed = [f.name for f in dataclasses.fields(transformers.TrainingArguments)]
    assert unclassified(installed) == [], f"transformers {transformers.__version__}"
    assert set(installed) <= set(TRAINING_ARGUMENTS_FIELDS), "new fields: record them in TRAINING_ARGUMENTS_FIELDS"


def test_every_field_of_trls_grpo_config_is_classified():
    trl = pytest.importorskip("trl")  # `pip install 'forge-rl[bench]'` brings TRL
    inherited = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    own = [f.name for f in dataclasses.fields(trl.GRPOConfig) if f.name not in inherited]
    assert unclassified(own) == [], f"TRL {trl.__version__}"
    assert set(own) <= set(TRL_GRPO_FIELDS), "new fields: record them in TRL_GRPO_FIELDS"


def test_the_recorded_fields_are_classified_and_each_name_has_one_class():
    assert unclassified(TRAINING_ARGUMENTS_FIELDS + TRL_GRPO_FIELDS) == []
    tables = [FORGE_FIELDS, set(TRL_NAMES), set(TRL_CONVERTED), set(TRL_IGNORED), set(TRL_REFUSED)]
    for i, one in enumerate(tables):
        for other in tables[i + 1:]:
            assert one & other == set()


def test_docs_from_trl_holds_the_generated_tables():
    page = (Path(__file__).resolve().parents[2] / "docs" / "from-trl.md").read_text(encoding="utf-8")
    assert trl_tables_markdown() in page, "docs/from-trl.md is stale: paste `python -m forge.core.config_docs trl`"


@pytest.mark.parametrize("field", dataclasses.fields(transformers.TrainingArguments), ids=lambda f: f.name)
def test_each_training_arguments_default_is_taken(field):
    """A script that spells out a TrainingArguments default gets a config, whatever the field's class."""
    if field.name == "output_dir":
        return  # None there means "the current directory"; Forge's field is a path
    GRPOConfig(**{field.name: default_of(field)})


@pytest.mark.parametrize("name", sorted(TRL_IGNORED))
def test_an_ignored_name_changes_nothing(name):
    assert GRPOConfig(**{name: 7}) == DEFAULT


@pytest.mark.parametrize("name", sorted(TRL_REFUSED))
def test_a_refused_name_is_refused_with_its_reason_unless_off(name):
    with pytest.raises(TypeError, match=f"{name}=.*has no Forge equivalent: " + re.escape(TRL_REFUSED[name])):
        GRPOConfig(**{name: "on"})
    assert GRPOConfig(**{name: None}) == DEFAULT


def test_the_strategies_map_to_forges_steps():
    assert GRPOConfig(save_strategy="no").save_steps == 0
    assert GRPOConfig(save_strategy="steps", save_steps=7).save_steps == 7
    assert GRPOConfig(eval_strategy="no").eval_steps == 0
    assert GRPOConfig(eval_strategy="steps", logging_steps=3).eval_steps == 3  # as TRL: eval_steps = logging_steps
    assert GRPOConfig(eval_strategy="steps", eval_steps=5).eval_steps == 5
    assert GRPOConfig(logging_strategy="steps", logging_steps=2).logging_steps == 2
    for name in ("save_strategy", "eval_strategy", "logging_strategy"):
        with pytest.raises(TypeError, match=f"{name}='epoch': Forge counts .* in optimizer steps"):
            GRPOConfig(**{name: "epoch"})
    with pytest.raises(TypeError, match="logging_strategy='no': Forge always writes training_log.jsonl"):
        GRPOConfig(logging_strategy="no")


def test_converted_training_arguments():
    assert GRPOConfig(warmup_steps=0.1).warmup_ratio == 0.1
    assert GRPOConfig(warmup_steps=5, max_steps=50).warmup_ratio == 0.1
    with pytest.raises(TypeError, match="warmup_steps=5: with no max_steps .* set warmup_ratio"):
        GRPOConfig(warmup_steps=5)
    assert GRPOConfig(lr_scheduler_type="constant_with_warmup").lr_scheduler == "constant"
    assert GRPOConfig(resume_from_checkpoint=True).resume_from == "latest"
    assert GRPOConfig(resume_from_checkpoint="out/checkpoint-40").resume_from == "out/checkpoint-40"
    assert GRPOConfig(train_sampling_strategy="sequential").shuffle is False
    assert GRPOConfig(activation_checkpointing=True).gradient_checkpointing is True
    assert GRPOConfig(eval_on_start=True).eval_before_training is True
    assert (GRPOConfig(project="p").wandb_project, GRPOConfig(project="p").trackio_project) == ("p", "p")
    assert GRPOConfig(run_name="r").wandb_run_name == "r"
    assert GRPOConfig(model_init_kwargs={"torch_dtype": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(TypeError, match=r"model_init_kwargs \['attn_implementation'\]: .*pass the model object"):
        GRPOConfig(model_init_kwargs={"attn_implementation": "sdpa"})
    assert GRPOConfig(gradient_checkpointing_kwargs={"use_reentrant": False}) == DEFAULT
    with pytest.raises(TypeError, match="gradient_checkpointing_kwargs=.*non-reentrantly"):
        GRPOConfig(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert GRPOConfig(optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8) == DEFAULT
    with pytest.raises(TypeError, match="optim='adafactor': Forge's optimizer is torch's AdamW"):
        GRPOConfig(optim="adafactor")
    with pytest.raises(TypeError, match="adam_beta2=0.95: Forge's AdamW uses torch's betas"):
        GRPOConfig(adam_beta2=0.95)
    assert GRPOConfig(repetition_penalty=1.0, vllm_tensor_parallel_size=1, push_to_hub=False) == DEFAULT
    with pytest.raises(TypeError, match="push_to_hub=True has no Forge equivalent: Forge reaches no hub"):
        GRPOConfig(push_to_hub=True)


def test_trl_names_that_ask_for_two_values_of_one_field_are_refused_as_transformers_refuses_bf16_with_fp16():
    with pytest.raises(TypeError, match=r"GRPOConfig got bf16=True and fp16=True, which ask for dtype='bfloat16' and "
                                        r"dtype='float16': give one of them$"):
        GRPOConfig(bf16=True, fp16=True)
    assert GRPOConfig(bf16=True, fp16=False).dtype == "bfloat16"
    assert GRPOConfig(bf16=True, model_init_kwargs={"torch_dtype": "bfloat16"}).dtype == "bfloat16"  # they agree


def test_a_published_grpo_scripts_arguments_make_a_valid_config(tmp_path):
    """The TrainingArguments most GRPO scripts set, TRL's spelling throughout."""
    config = GRPOConfig(
        output_dir=str(tmp_path), run_name="qwen-grpo", learning_rate=5e-6, adam_beta1=0.9, adam_beta2=0.999,
        weight_decay=0.1, warmup_ratio=0.1, lr_scheduler_type="cosine", optim="adamw_torch_fused", logging_steps=1,
        bf16=True, per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8,
        max_completion_length=256, num_train_epochs=1, save_strategy="steps", save_steps=100, save_total_limit=2,
        max_grad_norm=0.1, report_to="none", gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, eval_strategy="steps", eval_steps=50,
        per_device_eval_batch_size=16, seed=0, logging_strategy="steps", push_to_hub=False,
        dataloader_num_workers=2, remove_unused_columns=False, log_on_each_node=False, tf32=True,
        use_vllm=False, beta=0.04, loss_type="dr_grpo", scale_rewards="batch", log_completions=2,
    ).validate()
    assert (config.dtype, config.gradient_checkpointing, config.eval_steps, config.wandb_run_name,
            config.num_train_epochs) == ("bfloat16", True, 50, "qwen-grpo", 1)
    # TRL: 8 completions x 4 accumulated passes = 32 per optimizer step, one generation of 4 prompts x 8
    assert (config.prompts_per_step, config.gradient_accumulation_steps, config.micro_batch_size) == (4, 1, 8)
