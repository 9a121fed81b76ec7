"""The compiled static-cache decode step (forge/model/decode_plan.py) against the eager reference on the tiny model.

Both run the same weights on the same tokens; they differ only in floating-point summation order (compiled C++
kernels, attention over the masked static capacity instead of the filled length). In fp32 that moves a
log-prob by ~1e-6 of its size; the tolerance below, 1e-4 on log-probs of magnitude <~ 6, bounds it with room,
and greedy / sampled tokens agree unless two tokens tie to that precision (none do on these prompts).
"""

import pytest
import torch

from forge import GRPOConfig
from forge.core.rollout import SamplingSettings, generate
from forge.model import decode_plan
from forge.model.kv_cache import preallocated, returned_cache
from forge.model.decode_plan import DecodePlan, resolve_backend

PROMPTS = ["What is 2 + 3?", "Name a color:", "Count to five:"]


def _rollout(model, tokenizer, backend: str, do_sample: bool):
    settings = SamplingSettings(max_new_tokens=20, temperature=1.0, do_sample=do_sample, backend=backend)
    noise = torch.rand(len(PROMPTS) * 4, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return generate(model, tokenizer, PROMPTS, 4, settings, noise=noise if do_sample else None)


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens_and_logprobs(tiny_model, tiny_tokenizer, monkeypatch):
    tiny_model.eval()
    steps, real_call = [], decode_plan.StaticDecoder.__call__
    monkeypatch.setattr(decode_plan.StaticDecoder, "__call__", lambda self, *a: steps.append(self.batch) or
                        real_call(self, *a))
    # a sixth of the vocabulary ends a row: the random model's rows end at different steps
    tiny_model.generation_config.eos_token_id = [tiny_tokenizer.eos_token_id, *range(10, 10 + len(tiny_tokenizer) // 6)]
    for do_sample in (False, True):
        eager = _rollout(tiny_model, tiny_tokenizer, "eager", do_sample)
        compiled = _rollout(tiny_model, tiny_tokenizer, "compiled", do_sample)
        assert torch.equal(compiled.completion_ids, eager.completion_ids)
        assert torch.equal(compiled.completion_mask, eager.completion_mask)
        torch.testing.assert_close(compiled.sampler_logprobs, eager.sampler_logprobs, atol=1e-4, rtol=0)
    lengths = eager.completion_lengths
    assert lengths.min() < lengths.max()  # rows left the batch at different steps
    assert steps[0] == 16 and min(steps) < 16  # 12 rows in a bucket of 16, compacted on the way


def test_static_decoder_compacts_to_the_live_rows_and_steps_like_eager(tiny_model, tiny_tokenizer, monkeypatch):
    """Rows leave; when the live ones fit half the bucket the static cache shrinks to the next power of two, keeping
    each live row's keys, and the next step's logits are the eager step's. The forward runs uncompiled here (the
    compile is the slow test's)."""
    monkeypatch.setattr(decode_plan, "_compiled_forward", lambda device_type: decode_plan._forward)
    tiny_model.eval()
    ids = torch.randint(3, len(tiny_tokenizer), (6, 5), generator=torch.Generator().manual_seed(0))
    mask, keep = torch.ones(6, 6, dtype=torch.long), torch.tensor([1, 4, 5])
    tokens, positions = torch.tensor([7, 8, 9]), torch.full((3,), 5)
    with torch.no_grad():
        caches = [preallocated(returned_cache(tiny_model(input_ids=ids, use_cache=True)), 5 + 8) for _ in range(2)]
        eager_step = DecodePlan("eager").decode_step(tiny_model, caches[0])
        step = DecodePlan("compiled").decode_step(tiny_model, caches[1])
        assert isinstance(step, decode_plan.StaticDecoder) and step.batch == 8 and step.capacity == 64
        keys_of_row_4 = step.static.layers[0].keys[4, :, :5].clone()
        step.keep(keep)
        eager_step.keep(keep)
        assert step.batch == 4 and step.slots.tolist() == [0, 1, 2]  # 3 live rows fit half of 8
        assert torch.equal(step.static.layers[0].keys[1, :, :5], keys_of_row_4)
        torch.testing.assert_close(step(tokens, mask[keep], positions), eager_step(tokens, mask[keep], positions),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("units, measured, measured_fp32", [
    ("AMX tiles", "AMX Xeon", None), ("AVX512-BF16", "AVX512-BF16 AMD EPYC", None),
    ("no bf16 units", None, "AVX2-only AMD EPYC")])
def test_auto_decodes_eagerly_unless_measured_faster(monkeypatch, units, measured, measured_fp32):
    """Whatever CPU runs the test, each kind gets the decision measured on that kind, and its note names it."""
    notes = []
    monkeypatch.setattr(decode_plan, "note", notes.append)
    monkeypatch.setattr(decode_plan, "_announced", set())
    monkeypatch.setattr(decode_plan, "_bf16_units", lambda: units)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert resolve_backend("auto", "cpu") == "eager"
    assert resolve_backend("auto", "cpu") == "eager"  # fp32
    if measured:
        assert measured in notes[0] and "bench/compiled_decode.py" in notes[0]
    else:
        assert "not measured on cpu bfloat16 with no bf16 units" in notes[0]
    if measured_fp32:
        assert measured_fp32 in notes[1] and "fp32" in notes[1]
    else:
        assert "not measured on cpu float32" in notes[1]
    monkeypatch.setitem(decode_plan.GENERATION_BACKEND_MEASURED, ("cpu", torch.float32, units), ("compiled", "test"))
    monkeypatch.setattr(decode_plan, "_announced", set())
    assert resolve_backend("auto", "cpu") == "compiled"
    assert resolve_backend("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="generation_backend='fast'"):
        resolve_backend("fast", "cpu")
    with pytest.raises(ValueError, match="generation_backend='fast'"):
        GRPOConfig(generation_backend="fast").validate()


def test_a_trainer_decides_how_it_decodes_once_and_its_steps_use_that_plan(tiny_model, tiny_tokenizer, tmp_path,
                                                                          monkeypatch):
    """The backend is resolved (and `auto`'s note printed) when the trainer is built, not at every generation; each
    step's generate gets the trainer's plan, so the decode loop only reads it."""
    from forge import GRPOTrainer
    from forge.core import trainer as trainer_module

    resolved, plans = [], []
    real_resolve, real_generate = decode_plan.resolve_backend, trainer_module.generate
    monkeypatch.setattr(decode_plan, "resolve_backend", lambda *a: resolved.append(a) or real_resolve(*a))
    monkeypatch.setattr(trainer_module, "generate", lambda *a, plan=None, **k: plans.append(plan) or real_generate(
        *a, plan=plan, **k))
    config = GRPOConfig(group_size=2, prompts_per_step=2, gradient_accumulation_steps=1, max_new_tokens=4,
                        max_steps=2, save_steps=0, logging_steps=1, preflight="off", dtype="float32",
                        output_dir=str(tmp_path / "run"))
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, lambda prompts, completions, **kw: [0.0] * len(completions),
                          config)
    assert len(resolved) == 1 and trainer.decode_plan.backend == "eager"
    trainer.train([{"prompt": f"What is {a} + 1?"} for a in range(4)])
    assert len(resolved) == 1  # not again in either step
    assert len(plans) == 2 and all(plan is trainer.decode_plan for plan in plans)
    assert trainer.decode_plan.shared_prompt  # the tiny model's sdpa attention reads each group's prompt once


def test_with_tools_the_plan_is_the_eager_step_over_the_repeated_prompt(tiny_model):
    plan = DecodePlan.of(tiny_model, "compiled", with_tools=True)  # tool results are fed between tokens
    assert plan.backend == "eager" and plan.shared_prompt == ()
    assert DecodePlan.of(tiny_model, "compiled").backend == "compiled"
