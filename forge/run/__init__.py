"""The run machinery below the trainer: the run loop, lifecycle, checkpoints, the optimizer
step, step metrics."""
