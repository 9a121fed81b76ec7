"""What the TRL-script tests share (test_from_trl.py, test_trl_trainer.py): their prompts and TRL's config for them."""

from forge import GRPOConfig

PROMPTS = ["What is 2 + 3?", "Name a color.", "Count to three.", "Say yes."]


def trl_args(tmp_path, **overrides) -> GRPOConfig:
    """A GRPOConfig written with TRL's names, as a TRL script writes it (two steps on the tiny model)."""
    values = {"output_dir": str(tmp_path / "out"), "logging_steps": 1, "num_generations": 4,
              "max_completion_length": 8, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
              "max_steps": 2, "learning_rate": 1e-2, "beta": 0.0, "report_to": "none",
              "preflight": "off"}  # the rewards' calls are counted from step 1
    return GRPOConfig(**(values | overrides))
