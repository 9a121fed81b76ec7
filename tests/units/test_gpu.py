"""GPU checks (`pytest -m gpu`, run by bench/gpu_check.sh on a machine with CUDA); skipped everywhere else.

The tiny model on one GPU: dtype='auto' picks bf16 compute there (if the GPU supports it) over float32 master
weights; a full and a LoRA step train finite weights; with num_iterations=2 the first update's ratio is 1;
a run resumes from its checkpoint; async GRPO samples one step off on the same GPU.
"""

import pytest
import torch

from forge import GRPOConfig, GRPOTrainer
from forge.model.tiny import build_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def text_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def gpu_trainer(tmp_path, tokenizer, name="run", **overrides) -> GRPOTrainer:
    model, _ = build_tiny_model(tokenizer, seed=0)
    values = {"group_size": 4, "max_new_tokens": 8, "gradient_accumulation_steps": 1, "prompts_per_step": 2,
              "learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
              "save_steps": 1, "max_steps": 2, "output_dir": str(tmp_path / name)}
    return GRPOTrainer(model.cuda(), tokenizer, text_length, GRPOConfig(**(values | overrides)))


@pytest.mark.parametrize("use_lora", [False, True])
def test_auto_dtype_step_on_gpu_keeps_fp32_masters(tmp_path, tiny_tokenizer, use_lora):
    trainer = gpu_trainer(tmp_path, tiny_tokenizer, use_lora=use_lora, lora_r=4, kl_beta=0.05)
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert trainer.precision.compute == expected
    trainer.train(ROWS)
    assert all(p.dtype == torch.float32 and p.is_cuda and bool(torch.isfinite(p).all()) for p in trainer.trainable)


def test_first_update_ratio_is_one_on_gpu(tmp_path, tiny_tokenizer):
    trainer = gpu_trainer(tmp_path, tiny_tokenizer, num_iterations=2, kl_beta=0.0)
    updates, real_update = [], trainer.update
    trainer.update = lambda batch: updates.append(real_update(batch)) or updates[-1]
    trainer.train(ROWS[:2])
    assert updates[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_resume_on_gpu(tmp_path, tiny_tokenizer):
    gpu_trainer(tmp_path, tiny_tokenizer, max_steps=2).train(ROWS)
    resumed = gpu_trainer(tmp_path, tiny_tokenizer, max_steps=3, resume_from="latest")
    assert resumed.train(ROWS)["global_step"] == 3


def test_async_one_step_off_on_gpu(tmp_path, tiny_tokenizer):
    """The rollout worker's copy of the policy on the trainer's GPU; its weights through shared memory."""
    import json

    trainer = gpu_trainer(tmp_path, tiny_tokenizer, max_staleness=1, max_steps=3, save_steps=0, use_lora=True,
                          lora_r=4)
    trainer.train(ROWS)
    log = [json.loads(line) for line in (tmp_path / "run" / "training_log.jsonl").read_text().splitlines()]
    assert [row["async/staleness_max"] for row in log] == [0.0, 1.0, 1.0]
    assert all(p.is_cuda and bool(torch.isfinite(p).all()) for p in trainer.trainable)
