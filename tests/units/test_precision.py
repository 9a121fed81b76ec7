"""bf16 done right: float32 master weights under bf16 autocast, and dtype='auto' chosen by what the hardware does.

Before: a bf16 model was trained by AdamW directly on bf16 weights, where an update below ~1/256 of a weight
rounds away (measured on a tiny Llama, lr 5e-6, 3 steps: 81.7% more weights never moved than in fp32, update
norm 0.34x). Now the trainable weights are float32 and only the compute is bf16.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from forge import GRPOConfig, GRPOTrainer
from forge.model import Precision, apply_lora, as_master_weights, choose_precision
from forge.model.tiny import build_tiny_model

ROWS = [{"prompt": f"What is {a} + {b}?", "reference": str(a + b)} for a, b in [(2, 3), (4, 1), (7, 5), (6, 6)]]


def text_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def config(tmp_path, name, **overrides) -> GRPOConfig:
    values = {"preflight": "off", "group_size": 4, "max_new_tokens": 6, "gradient_accumulation_steps": 1, "prompts_per_step": 2,
              "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 0, "max_steps": 3,
              "kl_beta": 0.0, "output_dir": str(tmp_path / name)}  # learning_rate: Forge's default 5e-6
    return GRPOConfig(**(values | overrides))


def moved(before: dict, after: dict) -> tuple[float, float]:
    """(share of weights that never moved, norm of the update) over every weight."""
    unchanged = sum(int((after[k] == before[k]).sum()) for k in before)
    total = sum(before[k].numel() for k in before)
    norm = sum(float((after[k].float() - before[k].float()).pow(2).sum()) for k in before) ** 0.5
    return unchanged / total, norm


def test_bf16_full_finetuning_moves_as_many_weights_as_fp32(tmp_path, tiny_tokenizer):
    results = {}
    for dtype in ("float32", "bfloat16"):
        model, _ = build_tiny_model(tiny_tokenizer, seed=0)
        model = model.to(getattr(torch, dtype))  # a user's bf16 model, as from_pretrained(dtype=bfloat16) gives
        before = {k: v.detach().float().clone() for k, v in model.named_parameters()}
        trainer = GRPOTrainer(model, tiny_tokenizer, text_length, config(tmp_path, dtype, dtype=dtype))
        trainer.train(ROWS)
        results[dtype] = moved(before, {k: v.detach().float() for k, v in trainer.model.named_parameters()})
        assert all(p.dtype == torch.float32 for p in trainer.trainable)  # master weights
    (fp32_unchanged, fp32_norm), (bf16_unchanged, bf16_norm) = results["float32"], results["bfloat16"]
    assert bf16_unchanged <= fp32_unchanged + 0.05, results
    assert 0.5 <= bf16_norm / fp32_norm <= 2.0, results


def test_bf16_compute_keeps_the_first_update_ratio_at_one(tmp_path, tiny_model, tiny_tokenizer):
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, text_length,
                          config(tmp_path, "ratio", dtype="bfloat16", num_iterations=2, max_steps=2,
                                 learning_rate=5e-2))
    updates, real_update = [], trainer.update
    trainer.update = lambda batch: updates.append(real_update(batch)) or updates[-1]
    assert trainer.precision.compute == torch.bfloat16
    trainer.train(ROWS[:2])
    # pi_old is computed by the same bf16 forward as pi_theta on unchanged weights: ratio exactly 1
    assert updates[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and updates[0]["clip_ratio/region_mean"] == 0
    assert abs(updates[1]["ratio_mean"] - 1.0) > 1e-5  # the second update moved


def test_bf16_lora_keeps_a_bf16_base_and_fp32_adapters_and_saves_fp32(tmp_path, tiny_model, tiny_tokenizer):
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, text_length,
                          config(tmp_path, "lora", dtype="bfloat16", use_lora=True, lora_r=4, save_steps=3))
    trainer.train(ROWS)
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16} and {p.dtype for p in trainer.trainable} == {torch.float32}
    saved = load_file(tmp_path / "lora" / "checkpoint-3" / "adapter_model.safetensors")
    assert saved and all(t.dtype == torch.float32 for t in saved.values())


def test_bf16_full_checkpoint_holds_fp32_masters(tmp_path, tiny_model, tiny_tokenizer):
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, text_length,
                          config(tmp_path, "full", dtype="bfloat16", kl_beta=0.1, max_steps=1))
    assert {p.dtype for p in trainer.reference_model.parameters()} == {torch.bfloat16}  # frozen: bf16 is enough
    trainer.train(ROWS)
    saved = load_file(tmp_path / "full" / "final" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())
    log = [json.loads(line) for line in (tmp_path / "full" / "training_log.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in log)


@pytest.mark.parametrize(("amx", "avx512_bf16", "expected", "why"), [
    (True, False, torch.bfloat16, "AMX"),
    (False, True, torch.bfloat16, "AVX512-BF16"),
    (False, False, torch.float32, "no bf16 matrix units"),
])
def test_auto_picks_bf16_only_on_cpus_with_bf16_units(monkeypatch, amx, avx512_bf16, expected, why):
    monkeypatch.delenv("FORGE_CPU_BF16")  # conftest pins "auto" to fp32 for the rest of the suite
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    chosen = choose_precision("auto", "cpu")
    assert chosen.compute == expected and why in chosen.reason
    assert choose_precision("float32", "cpu").compute == torch.float32  # forced, whatever the CPU


def test_the_choice_is_logged(tmp_path, tiny_model, tiny_tokenizer, capsys):
    GRPOTrainer(tiny_model, tiny_tokenizer, text_length, config(tmp_path, "log", dtype="float32"))
    assert "precision: float32 (dtype='float32' was asked for)" in capsys.readouterr().err


def test_fp16_uses_a_dynamic_loss_scale_and_an_overflow_only_halves_it(tmp_path, tiny_model, tiny_tokenizer):
    trainer = GRPOTrainer(tiny_model, tiny_tokenizer, text_length,
                          config(tmp_path, "fp16", dtype="float16", max_consecutive_nonfinite=1, learning_rate=1e-2))
    assert trainer.guard.loss_scale == 2.0**16
    overflowed = []

    def overflow_once(grad):  # what an fp16 backward that overflowed hands back
        if not overflowed:
            overflowed.append(1)
            return torch.full_like(grad, float("inf"))
        return grad

    trainer.trainable[0].register_hook(overflow_once)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train(ROWS)  # an overflow is not a failure: no abort even with max_consecutive_nonfinite=1
    assert trainer.guard.loss_scale == 2.0**15 and trainer.guard.skipped_steps == 1
    after = dict(trainer.model.named_parameters())
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # steps 2 and 3 trained


def test_bf16_lora_inputs_stay_bf16_and_give_the_same_bits(tiny_model, tiny_tokenizer):
    # PEFT casts each LoRA layer's input to the adapters' fp32 and autocast casts it straight back to bf16:
    # Forge's autocast(model) skips that round trip; the loss and every gradient must be bit for bit the same.
    bf16 = Precision(torch.bfloat16, "cpu", "test", uncast_lora_inputs=True)
    model = apply_lora(tiny_model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    model = as_master_weights(model, bf16, lora=True)
    seen = []
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    ids = torch.randint(0, len(tiny_tokenizer), (3, 12), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(context):
        model.zero_grad()
        seen.clear()
        with context:
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad], set(seen)

    plain_loss, plain_grads, plain_inputs = loss_and_grads(torch.autocast("cpu", dtype=torch.bfloat16))
    loss, grads, inputs = loss_and_grads(bf16.autocast(model))
    assert plain_inputs == {torch.float32} and inputs == {torch.bfloat16}
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert all(m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "cast_input_dtype_enabled"))


def test_forge_cpu_bf16_overrides_the_detection(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setenv("FORGE_CPU_BF16", "0")
    chosen = choose_precision("auto", "cpu")
    assert chosen.compute == torch.float32 and "FORGE_CPU_BF16=0" in chosen.reason
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setenv("FORGE_CPU_BF16", "1")
    assert choose_precision("auto", "cpu").compute == torch.bfloat16
    monkeypatch.setenv("FORGE_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="set it to 0"):
        choose_precision("auto", "cpu")


def _packs_bf16_here() -> bool:
    from forge.model.packed_linear import packing_applies

    return packing_applies(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("kind", [
    "no bf16 units",  # the AVX2-only CPU's detection, mocked on every machine: weights unpacked, autocast casts
    pytest.param(None, marks=pytest.mark.skipif(not _packs_bf16_here(), reason=(
        "this CPU does not pack bf16 linear layers (oneDNN needs AVX512-BF16 or AMX): its kind is the row above"))),
])
def test_bf16_generation_casts_each_master_weight_once_not_per_decode_step(tmp_path, tiny_model, tiny_tokenizer,
                                                                          monkeypatch, kind):
    # autocast keeps the bf16 copy of a trainable fp32 weight while its context is open (not in inference mode);
    # packed layers cast each weight once per generation; so the number of weight casts must not grow with the
    # number of decode steps, on a CPU that packs bf16 (None: this machine's own kind, where it packs) and on one
    # that does not (its detection mocked)
    from torch.profiler import profile

    import forge.model.packed_linear as packed_linear

    if kind is not None:
        monkeypatch.setattr(packed_linear, "_bf16_units", lambda: kind)

    shapes = {tuple(p.shape) for p in tiny_model.parameters() if p.dim() == 2}
    counts = []
    for tokens in (2, 8):
        trainer = GRPOTrainer(tiny_model, tiny_tokenizer, text_length,
                              config(tmp_path, f"casts{tokens}", dtype="bfloat16", max_new_tokens=tokens))
        with profile(record_shapes=True) as prof:
            rollout = trainer.sample_completions([ROWS[0]["prompt"]])
        assert rollout.completion_mask.sum(dim=1).max() == tokens  # this many decode steps
        counts.append(sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                          if e.key == "aten::_to_copy" and e.input_shapes and tuple(e.input_shapes[0]) in shapes))
    assert counts[0] > 0 and counts[0] == counts[1], counts


def test_cpu_name_tells_apart_cpus_a_virtual_machine_names_alike(tmp_path):
    """Figures name the CPU: two EPYC generations that KVM shows as "AMD EPYC" differ in family and model;
    only the first processor's fields count; a CPU without those fields (Arm) keeps its plain name."""
    from forge.model import cpu_name

    zen5 = tmp_path / "zen5"
    zen5.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 99\nmodel\t\t: 9\n"
                    "model name\t: Other\n")
    assert cpu_name(str(zen5)) == "AMD EPYC (family 26, model 2)"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nmodel name\t: Neoverse-V2\nBogoMIPS\t: 2000.00\n")
    assert cpu_name(str(arm)) == "Neoverse-V2"
    assert cpu_name(str(tmp_path / "absent"))  # no /proc/cpuinfo: what platform knows, never empty
