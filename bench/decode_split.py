"""Where the own decode's time goes, unprofiled: wall time of each part of the demo's generation per decode step.

The demo's trainer (bench/workloads.py demo_trainer: the packaged SmolLM2-135M, its LoRA adapters with seeded
random B matrices, 4 prompts x 8 completions, up to 64 new tokens) generates `--rounds` times after a warm-up, in
the run's precision; the functions below are wrapped in a perf_counter timer (no profiler, so no per-operator
cost is added; each timed call adds ~1 us). Parts nest: `decode step` holds the model's forward of one token for
every running row, which holds the linear products, the attention over each group's prompt once, the norms and
the rotary embedding; `generation` holds everything, the prefill, the sampler, packing the weights and the loop's
bookkeeping included. Printed in ms per decode step (the last round) and written to
bench/results/decode_split[_TAG].json.

    python bench/decode_split.py [--rounds 3] [--threads 1] [--tag amx]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class Timers:
    def __init__(self):
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def wrap(self, owner, name: str, part: str) -> None:
        """Time every call of owner.name as `part`."""
        setattr(owner, name, self.timed(getattr(owner, name), part))

    def timed(self, function, part: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - started
                self.calls[part] += 1
        return timed

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import tempfile

    from transformers.models.llama import modeling_llama
    from workloads import demo_trainer, machine_info

    from forge.core import rollout
    from forge.model import decode_plan, kv_cache, packed_linear

    timers = Timers()
    timers.wrap(packed_linear, "_packed_forward", "linear products (packed)")
    timers.wrap(packed_linear, "_packed", "packing the weights")
    timers.wrap(kv_cache.SharedPrefixLayer, "attend", "attention over the shared prompt")
    timers.wrap(modeling_llama.LlamaRMSNorm, "forward", "RMS norms")
    timers.wrap(modeling_llama, "apply_rotary_pos_emb", "rotary embedding")
    timers.wrap(rollout, "sample_with_logprobs", "sampler")
    timers.wrap(decode_plan, "prefill_groups", "prefill")
    timers.wrap(rollout, "still_running", "finished rows leaving")
    timers.wrap(decode_plan.EagerStep, "__call__", "decode step")

    with tempfile.TemporaryDirectory() as output_dir:
        trainer, prompts = demo_trainer(output_dir)
        if not any(isinstance(m, modeling_llama.LlamaRMSNorm) for m in trainer.model.modules()):
            sys.exit("bench/decode_split.py times Llama-family layers (the packaged model)")
        rounds = []
        for round_index in range(args.rounds + 1):  # the first is a warm-up
            trainer.sampling_rng.manual_seed(round_index)
            timers.clear()
            started = time.perf_counter()
            rollout_ = trainer.generate(prompts)
            timers.seconds["generation"] = time.perf_counter() - started
            steps = timers.calls["decode step"]
            rounds.append({"decode_steps": steps, "tokens": int(rollout_.completion_mask.sum()),
                           "ms_per_decode_step": {part: 1e3 * s / steps for part, s in timers.seconds.items()},
                           "calls_per_decode_step": {part: c / steps for part, c in timers.calls.items()}})
    last = rounds[-1]
    print(f"{machine_info(args.threads)['cpu_model']}, {args.threads} thread(s): {last['tokens']} tokens in "
          f"{last['decode_steps']} decode steps")
    for part, ms in sorted(last["ms_per_decode_step"].items(), key=lambda item: -item[1]):
        print(f"  {part:36s} {ms:7.1f} ms per decode step  ({last['calls_per_decode_step'].get(part, 1):.1f} calls)")
    name = f"decode_split{'_' + args.tag if args.tag else ''}.json"
    (HERE / "results" / name).write_text(json.dumps({"machine": machine_info(args.threads),
                                                     "rounds": rounds[1:]}, indent=1))
    print(f"wrote bench/results/{name}")


if __name__ == "__main__":
    main()
