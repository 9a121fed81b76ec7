"""The rest of a TRL script, not only its GRPO lines (docs/from-trl.md, "your TRL script, line by line").

Each script is written as TRL's and transformers' documentation write it, with one changed import
(`from forge import GRPOConfig, GRPOTrainer`) and the tiny offline model saved to a folder in place of a hub id:
`peft_config=LoraConfig(...)` as peft means it, `eval_dataset` with `eval_strategy`, transformers'
`TrainerCallback` objects (a logging one, one that stops training, one that asks for a checkpoint),
`trainer.state`, `trainer.save_model`, `trainer.evaluate()` and `train(resume_from_checkpoint=True)`.
"""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import TrainerCallback, TrainerControl, TrainerState
from trl_scripts import PROMPTS, trl_args

from forge import GRPOConfig, GRPOTrainer  # the one line a TRL script changes
from forge.model.tiny import build_tiny_model


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def adapted(model) -> tuple[list[str], list[str], dict]:
    """The LoRA layers of a PeftModel, its trainable weights, and each layer's scaling."""
    layers = sorted(name.removeprefix("base_model.model.") for name, m in model.named_modules()
                    if isinstance(m, LoraLayer))
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    scaling = {name: dict(m.scaling) for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    return layers, trainable, scaling


@pytest.mark.parametrize("peft_config", [
    LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    LoraConfig(r=4, target_modules=r".*\.(q_proj|down_proj)", task_type="CAUSAL_LM"),
    LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[1], layers_pattern="layers"),
    LoraConfig(r=4, target_modules=["k_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM"),
    LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True, task_type="CAUSAL_LM"),
    LoraConfig(r=4, target_modules=["o_proj", "up_proj"], use_dora=True, task_type="CAUSAL_LM"),
    LoraConfig(r=4, task_type="CAUSAL_LM"),  # no target_modules: peft's own default for the architecture
], ids=["all-linear", "regex", "layers_to_transform", "modules_to_save", "rslora", "dora", "peft-default"])
def test_forge_adapts_exactly_the_modules_peft_adapts(peft_config, tmp_path):
    model, tokenizer = build_tiny_model(seed=0)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_len,
                          args=trl_args(tmp_path), peft_config=peft_config)
    reference, _ = build_tiny_model(seed=0)
    expected = adapted(get_peft_model(reference, peft_config))
    assert adapted(trainer.model) == expected
    assert expected[0], "the config adapts something"
    assert trainer.config.use_lora and trainer.config.lora_r == peft_config.r


def test_a_peft_config_forge_cannot_train_is_refused_naming_the_field(tmp_path):
    for config, message in ((LoraConfig(target_modules="all-linear", bias="all"), "peft_config.bias='all'"),
                            (LoraConfig(target_modules="all-linear", init_lora_weights="pissa"),
                             "peft_config.init_lora_weights='pissa' rewrites the base weights")):
        with pytest.raises(TypeError, match=message):
            GRPOTrainer(model="no/such-model", reward_funcs=reward_len, args=trl_args(tmp_path),
                        peft_config=config)


def test_the_trl_lora_script_trains_and_saves_the_adapter(model_folder, tmp_path):
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=trl_args(tmp_path),
                          train_dataset=dataset, peft_config=peft_config)
    trainer.train()
    trainer.save_model(tmp_path / "adapter")

    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {name.rsplit(".", 1)[-1] for name in saved["target_modules"]} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # every linear layer but lm_head
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "adapter" / "tokenizer_config.json").is_file()
    assert trainer.state.global_step == 2 and (tmp_path / "out" / "final" / "adapter_config.json").is_file()
    assert trainer.processing_class is trainer.tokenizer and trainer.args is trainer.config
    assert peft_config.target_modules == "all-linear"  # the caller's LoraConfig is left as it was


class Recorder(TrainerCallback):
    """A logging callback: what each event received."""

    def __init__(self):
        self.events, self.logs, self.evaluations = [], [], []

    def _seen(self, name, args, state, control):
        assert isinstance(state, TrainerState) and isinstance(control, TrainerControl)
        assert isinstance(args, GRPOConfig)
        self.events.append((name, state.global_step))

    def on_train_begin(self, args, state, control, **kwargs):
        self._seen("train_begin", args, state, control)
        assert kwargs["model"] is not None and kwargs["processing_class"] is not None
        assert state.max_steps == args.max_steps

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._seen("epoch_begin", args, state, control)

    def on_step_begin(self, args, state, control, **kwargs):
        self._seen("step_begin", args, state, control)

    def on_step_end(self, args, state, control, **kwargs):
        self._seen("step_end", args, state, control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._seen("log", args, state, control)
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._seen("evaluate", args, state, control)
        self.evaluations.append(dict(metrics))

    def on_save(self, args, state, control, **kwargs):
        self._seen("save", args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._seen("epoch_end", args, state, control)

    def on_train_end(self, args, state, control, **kwargs):
        self._seen("train_end", args, state, control)


def test_a_script_with_eval_dataset_eval_strategy_and_a_logging_callback(model_folder, tmp_path):
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:2]})
    recorder = Recorder()
    args = trl_args(tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2,
                         save_strategy="steps", save_steps=1, save_total_limit=1, logging_strategy="steps",
                         num_train_epochs=1, seed=3, bf16=False, gradient_checkpointing=False, push_to_hub=False,
                         dataloader_num_workers=2)
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=args, train_dataset=dataset,
                          eval_dataset=eval_dataset, callbacks=[recorder])
    trainer.train()

    assert [e for e in recorder.events if e[0] not in ("log", "evaluate")] == [
        ("train_begin", 0), ("epoch_begin", 0), ("step_begin", 0), ("step_end", 1), ("save", 1),
        ("step_begin", 1), ("step_end", 2), ("save", 2), ("epoch_end", 2), ("train_end", 2)]
    history = trainer.state.log_history
    assert recorder.logs == history  # every on_log row is a log_history row
    train_rows = [row for row in history if "reward" in row]
    eval_rows = [row for row in history if "eval_reward" in row]
    assert [row["step"] for row in train_rows] == [1, 2] and [row["step"] for row in eval_rows] == [1, 2]
    assert all(isinstance(row["loss"], float) for row in train_rows)
    assert [m["eval_n"] for m in recorder.evaluations] == [2, 2]
    logged = [json.loads(line) for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert logged == [row | {"time": logged_row["time"]} for row, logged_row in zip(history, logged)]
    assert "train_runtime" in history[-1] and len(history) == len(logged) + 1  # the summary: log_history only
    assert trainer.state.global_step == 2 and trainer.state.epoch == 1.0

    metrics = trainer.evaluate()  # TRL's call: eval_dataset, a metrics dict
    assert metrics["eval_n"] == 2 and isinstance(metrics["eval_reward"], float)


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def test_a_callback_that_stops_training_ends_the_run_as_max_steps_would(model_folder, tmp_path):
    recorder = Recorder()
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len,
                          args=trl_args(tmp_path, max_steps=6, save_strategy="no"),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 3}),
                          callbacks=[StopAfter(2), recorder])
    trainer.train()
    assert trainer.global_step == 2 and trainer.state.global_step == 2
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "checkpoint-2").exists()  # save_strategy="no": final/ only, as at max_steps
    assert recorder.events[-1] == ("train_end", 2)
    assert [row["step"] for row in trainer.state.log_history] == [1, 2, 2]  # the steps', then the run's summary


class SaveAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = state.global_step == 1


def test_a_callback_asks_for_a_checkpoint_and_train_resumes_from_it(model_folder, tmp_path):
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    first = GRPOTrainer(model=model_folder, reward_funcs=reward_len,
                        args=trl_args(tmp_path, max_steps=1, save_strategy="no"), train_dataset=dataset,
                        callbacks=[SaveAt])  # a class, as transformers takes it
    first.train()
    assert (tmp_path / "out" / "checkpoint-1").is_dir()
    saved = json.loads((tmp_path / "out" / "checkpoint-1" / "trainer_state.json").read_text())
    assert saved["log_history"] == first.state.log_history[:1] and [row["step"] for row in saved["log_history"]] == [1]
    assert "train_runtime" in first.state.log_history[1]  # the run's summary, logged after its last checkpoint

    second = GRPOTrainer(model=model_folder, reward_funcs=reward_len,
                         args=trl_args(tmp_path, max_steps=2, save_strategy="no"), train_dataset=dataset)
    second.train(resume_from_checkpoint=True)
    assert second.global_step == 2 and second.config.resume_from == "latest"
    assert [row["step"] for row in second.state.log_history] == [1, 2, 2]  # the checkpoint's rows, then this run's
    final = json.loads((tmp_path / "out" / "final" / "trainer_state.json").read_text())
    assert [row["step"] for row in final["log_history"]] == [1, 2]


def test_save_model_writes_the_model_where_it_is_asked(model_folder, tmp_path):
    trainer = GRPOTrainer(model=model_folder, reward_funcs=reward_len, args=trl_args(tmp_path))
    path = trainer.save_model(tmp_path / "model")
    assert (path / "model.safetensors").is_file() and (path / "tokenizer_config.json").is_file()
    with pytest.raises(ValueError, match="evaluate\\(\\) without rows evaluates eval_dataset"):
        trainer.evaluate()


def test_modules_to_save_and_dora_train_and_the_reference_stays_the_initial_model(tmp_path):
    """The adapter-disabled model is Forge's reference: after training with modules_to_save (a trained copy of
    lm_head) and DoRA it still computes what the initial model computed; the trained policy does not."""
    import torch

    model, tokenizer = build_tiny_model(seed=0)
    initial, _ = build_tiny_model(seed=0)
    peft_config = LoraConfig(r=4, target_modules="all-linear", modules_to_save=["lm_head"], use_dora=True,
                             task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_len,
                          args=trl_args(tmp_path, beta=0.04), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          peft_config=peft_config)
    trainer.train()
    ids = torch.tensor([[1, 7, 9, 11]])
    with torch.no_grad():
        expected = initial(ids).logits
        with trainer.model.disable_adapter():
            reference = trainer.model(ids).logits
        policy = trainer.model(ids).logits
    torch.testing.assert_close(reference, expected)
    assert not torch.allclose(policy, expected)


@pytest.mark.slow
def test_the_documented_script_on_the_packaged_model(tmp_path):
    """docs/from-trl.md's quickstart with LoRA on every linear layer, a stopping callback and save_model, on the
    packaged SmolLM2 ("default", offline)."""
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=4, max_completion_length=16,
                      per_device_train_batch_size=8, beta=0.0, logging_steps=1, max_steps=3, save_strategy="no",
                      report_to="none", preflight="off")
    trainer = GRPOTrainer(model="default", reward_funcs=reward_len, args=args, train_dataset=dataset,
                          callbacks=[StopAfter(1)],
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model(args.output_dir)
    assert trainer.state.global_step == 1 and (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert "reward" in trainer.state.log_history[-1]
