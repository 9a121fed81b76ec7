"""Policy loading, LoRA, the reference policy and export, on the tiny offline model."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge.model import (
    apply_lora,
    count_parameters,
    default_lora_targets,
    is_peft_model,
    load_for_eval,
    load_model,
    make_reference_model,
    merge_and_export,
    merged_adapters,
    packaged_model_path,
    prepare_tokenizer,
    reference_context,
    resolve_dtype,
)
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

peft = pytest.importorskip("peft")


def _input_ids(tokenizer, text="What is 12 + 7? Answer:"):
    return tokenizer(text, return_tensors="pt").input_ids  # (1, T)


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits  # (1, T, V)


def _randomize_lora_b(peft_model, seed=1):
    """peft starts B at zero (adapter is a no-op); give B random values so the adapter changes outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def _save_tiny_base(tiny_model, tiny_tokenizer, folder):
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


# --- tokenizer ---------------------------------------------------------------------------------------


def test_prepare_tokenizer_uses_eos_as_pad_and_logs(caplog):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    with caplog.at_level(logging.INFO, logger="forge"):
        prepared = prepare_tokenizer(tokenizer)
    assert prepared.pad_token == prepared.eos_token == "</s>"
    assert prepared.pad_token_id == prepared.eos_token_id
    assert prepared.padding_side == "left"
    assert any("pad" in record.getMessage() for record in caplog.records)


def test_prepare_tokenizer_keeps_existing_pad(tiny_tokenizer, caplog):
    tokenizer = build_tiny_tokenizer()
    with caplog.at_level(logging.INFO, logger="forge"):
        prepare_tokenizer(tokenizer)
    assert tokenizer.pad_token == "<pad>"
    assert tokenizer.padding_side == "left"
    assert not caplog.records


def test_prepare_tokenizer_without_pad_or_eos_says_what_to_do():
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="pad token"):
        prepare_tokenizer(tokenizer)


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float99")


# --- LoRA --------------------------------------------------------------------------------------------


def test_default_lora_targets_on_llama(tiny_model):
    assert default_lora_targets(tiny_model) == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_default_lora_targets_fall_back_to_linear_layers():
    model = torch.nn.Sequential()
    model.add_module("encoder", torch.nn.Linear(4, 4))
    model.add_module("lm_head", torch.nn.Linear(4, 8))
    assert default_lora_targets(model) == ["encoder"]


def test_apply_lora_trains_only_adapters(tiny_model):
    _, total_before = count_parameters(tiny_model)
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    assert is_peft_model(peft_model) and not is_peft_model(tiny_model.base_model)
    trainable, total = count_parameters(peft_model)

    # each adapted Linear(in, out) gains A (r, in) and B (out, r)
    config = tiny_model.config
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    kv_out = config.num_key_value_heads * head_dim
    per_layer = 4 * (hidden + hidden) + 4 * (hidden + kv_out) * 2 + 4 * (hidden + hidden)  # q, k+v, o
    expected_trainable = config.num_hidden_layers * per_layer
    assert trainable == expected_trainable
    assert total == total_before + expected_trainable
    trainable_names = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable_names and all("lora_" in name for name in trainable_names)
    assert apply_lora(peft_model) is peft_model


def test_wrapping_and_loading_adapters_hides_only_the_checkpointing_deprecation(tiny_model, tmp_path):
    """peft reads transformers' deprecated `is_gradient_checkpointing`; that FutureWarning is Forge's to hide,
    around its own calls only, and nothing else is."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = apply_lora(tiny_model, r=4, alpha=8)
        peft_model.save_pretrained(tmp_path / "adapter")
        base, tokenizer = build_tiny_model(seed=0)
        load_for_eval(base, tmp_path / "adapter", tokenizer=tokenizer)
        tiny_model.is_gradient_checkpointing  # noqa: B018 - a user's own read still warns
    deprecations = [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert len(deprecations) == 1  # the last line's


def test_loading_drops_only_transformers_unsharded_layers_line():
    """transformers' tensor-parallel plan check prints "The following layers were not sharded" at every load of a
    model with a plan (the packaged SmolLM2 too); Forge's loading drops that line, and nothing else."""
    import forge.model.loading  # noqa: F401 - where Forge loads models, and installs the filter

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.distributed.tensor_parallel")
    logger.addHandler(handler)
    try:
        logger.warning("The following layers were not sharded: model.norm.weight")
        logger.warning("The following rules were not applied: model.layers.*.mlp")
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == ["The following rules were not applied: model.layers.*.mlp"]


# --- reference policy --------------------------------------------------------------------------------


def test_reference_context_is_exactly_the_base_model(tiny_model, tiny_tokenizer):
    input_ids = _input_ids(tiny_tokenizer)
    base_logits = _logits(tiny_model, input_ids)
    base_state = {name: tensor.clone() for name, tensor in tiny_model.state_dict().items()}

    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    adapted_logits = _logits(peft_model, input_ids)
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-3)

    with reference_context(peft_model) as reference:
        assert reference is peft_model
        reference_logits = reference(input_ids=input_ids).logits
        assert not reference_logits.requires_grad
    torch.testing.assert_close(reference_logits, base_logits, atol=1e-6, rtol=0)

    # adapters are back on afterwards, and the base weights were never touched
    torch.testing.assert_close(_logits(peft_model, input_ids), adapted_logits, atol=0, rtol=0)
    fresh_base, _ = build_tiny_model(tiny_tokenizer, seed=0)
    fresh_base.load_state_dict(base_state)
    torch.testing.assert_close(_logits(fresh_base, input_ids), base_logits, atol=0, rtol=0)


def test_merged_adapters_give_the_adapted_outputs_and_put_the_weights_back(tiny_model, tiny_tokenizer):
    input_ids = _input_ids(tiny_tokenizer)
    base_logits = _logits(tiny_model, input_ids)
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    adapted_logits = _logits(peft_model, input_ids)
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-3)
    before = {name: (p, p.detach().clone()) for name, p in peft_model.named_parameters()}

    with merged_adapters(peft_model) as merged:
        assert merged
        merged_logits = _logits(peft_model, input_ids)
        q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
        # the weight really is W + (alpha / r) B A while inside, and the adapter path is off
        expected = before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"][1] + 2.0 * (
            q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight)
        torch.testing.assert_close(q_proj.base_layer.weight, expected, atol=1e-6, rtol=0)
        with merged_adapters(peft_model) as nested:  # already merged: nothing more happens
            assert not nested
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-5, rtol=0)
    assert not torch.allclose(merged_logits, base_logits, atol=1e-3)

    # afterwards: the same parameter objects, bit for bit, and the adapters (still trainable) are back on
    for name, parameter in peft_model.named_parameters():
        original, value = before[name]
        assert parameter is original
        assert torch.equal(parameter, value), name
        assert parameter.requires_grad == ("lora_" in name)
    torch.testing.assert_close(_logits(peft_model, input_ids), adapted_logits, atol=0, rtol=0)


def test_merged_adapters_restore_the_weights_after_an_error(tiny_model):
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    before = {name: p.detach().clone() for name, p in peft_model.named_parameters()}
    with pytest.raises(RuntimeError, match="inside"), merged_adapters(peft_model):
        raise RuntimeError("inside")
    assert all(torch.equal(p, before[name]) for name, p in peft_model.named_parameters())
    with merged_adapters(peft_model) as merged:  # and it can merge again
        assert merged


def test_merged_adapters_leave_other_models_alone(tiny_model):
    with merged_adapters(tiny_model) as merged:  # not a LoRA model
        assert not merged
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    with merged_adapters(peft_model, enabled=False) as merged:
        assert not merged
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(build_tiny_model(build_tiny_tokenizer(), seed=0)[0],
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
    with merged_adapters(dora) as merged:  # DoRA is not W + s B A
        assert not merged


def test_merged_adapters_keep_switched_off_adapters_off(tiny_model, tiny_tokenizer):
    """Evaluating the base model of a LoRA model (inside disable_adapter) must not merge the adapters back in."""
    input_ids = _input_ids(tiny_tokenizer)
    base_logits = _logits(tiny_model, input_ids)
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    with peft_model.disable_adapter(), merged_adapters(peft_model) as merged:
        assert not merged
        torch.testing.assert_close(_logits(peft_model, input_ids), base_logits, atol=1e-6, rtol=0)


def test_merged_adapters_in_bf16_round_the_fp32_sum_once_and_stay_as_exact_as_the_adapters(tiny_model, tiny_tokenizer):
    """Under bf16 autocast (a LoRA run's bf16 base, fp32 adapters), for evaluation (rounded=True), the merged weight
    is W + s B A formed in fp32 and rounded once to bf16, and the outputs are about as close to the exact fp32
    model's as the adapter path's; training's sampling (rounded=False) keeps the adapters."""
    input_ids = _input_ids(tiny_tokenizer)
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    exact = _logits(peft_model, input_ids)  # fp32 everywhere
    for name, parameter in peft_model.named_parameters():  # what as_master_weights does for a bf16 LoRA run
        if "lora_" not in name:
            parameter.data = parameter.data.to(torch.bfloat16)
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    weight = q_proj.base_layer.weight
    pointer, value = weight.data_ptr(), weight.detach().clone()
    expected = (value.float() + 2.0 * q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        adapters = _logits(peft_model, input_ids).float()
        with merged_adapters(peft_model) as merged:  # training's sampling: the rounding would widen the
            assert not merged  # sampler/trainer log-prob gap, so it keeps the adapters
        with merged_adapters(peft_model, rounded=True) as merged:  # evaluation
            assert merged
            assert torch.equal(q_proj.base_layer.weight, expected.to(torch.bfloat16))
            merged_logits = _logits(peft_model, input_ids).float()
    assert weight.data_ptr() == pointer and torch.equal(weight, value)  # the original tensor, put back
    adapters_error = (adapters - exact).abs().mean()
    assert (merged_logits - exact).abs().mean() <= 1.5 * adapters_error  # bf16 rounding of either path


def test_make_reference_model_is_a_frozen_copy(tiny_model, tiny_tokenizer):
    input_ids = _input_ids(tiny_tokenizer)
    reference = make_reference_model(tiny_model)
    assert count_parameters(reference)[0] == 0
    assert not reference.training
    with torch.no_grad():
        for parameter in tiny_model.parameters():
            parameter.add_(0.1)  # training the policy must not move the reference
    with reference_context(tiny_model, reference) as ref:
        assert ref is reference
        reference_logits = ref(input_ids=input_ids).logits
    fresh, _ = build_tiny_model(tiny_tokenizer, seed=0)
    torch.testing.assert_close(reference_logits, _logits(fresh, input_ids), atol=1e-6, rtol=0)


def test_reference_context_refuses_plain_model_without_reference(tiny_model):
    with pytest.raises(ValueError, match="make_reference_model"), reference_context(tiny_model):
        pass


# --- loading and export ------------------------------------------------------------------------------


def test_load_model_from_local_folder(tiny_model, tiny_tokenizer, tmp_path):
    folder = _save_tiny_base(tiny_model, tiny_tokenizer, tmp_path / "tiny")
    model, tokenizer = load_model(folder, device="cpu")
    assert model.dtype == torch.float32
    assert model.device.type == "cpu"
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<pad>"
    input_ids = _input_ids(tokenizer)
    torch.testing.assert_close(_logits(model, input_ids), _logits(tiny_model, input_ids), atol=0, rtol=0)


def test_load_model_missing_gguf_file_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF"):
        load_model(tmp_path / "missing.gguf", device="cpu")


def test_merge_and_export_round_trip_from_adapter_folder(tiny_model, tiny_tokenizer, tmp_path):
    base_dir = _save_tiny_base(tiny_model, tiny_tokenizer, tmp_path / "base")
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    input_ids = _input_ids(tiny_tokenizer)
    adapted_logits = _logits(peft_model, input_ids)

    out_dir = merge_and_export(tmp_path / "adapter", base_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out_dir)
    assert not is_peft_model(merged)
    assert (out_dir / "tokenizer_config.json").is_file()
    torch.testing.assert_close(_logits(merged, input_ids), adapted_logits, atol=1e-5, rtol=0)


def test_merge_and_export_live_model_keeps_its_adapters(tiny_model, tiny_tokenizer, tmp_path):
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    input_ids = _input_ids(tiny_tokenizer)
    adapted_logits = _logits(peft_model, input_ids)

    out_dir = merge_and_export(peft_model, "unused-base", tmp_path / "merged", tokenizer=tiny_tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(out_dir)
    torch.testing.assert_close(_logits(merged, input_ids), adapted_logits, atol=1e-5, rtol=0)
    assert is_peft_model(peft_model)
    torch.testing.assert_close(_logits(peft_model, input_ids), adapted_logits, atol=0, rtol=0)


def test_load_for_eval_applies_adapter(tiny_model, tiny_tokenizer, tmp_path):
    base_dir = _save_tiny_base(tiny_model, tiny_tokenizer, tmp_path / "base")
    peft_model = apply_lora(tiny_model, r=4, alpha=8)
    _randomize_lora_b(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    input_ids = _input_ids(tiny_tokenizer)

    model, tokenizer = load_for_eval(base_dir, adapter=tmp_path / "adapter", device="cpu")
    assert is_peft_model(model) and not model.training
    assert tokenizer.padding_side == "left"
    torch.testing.assert_close(_logits(model, input_ids), _logits(peft_model, input_ids), atol=1e-6, rtol=0)


def test_packaged_model_path_reuses_a_completed_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / ".forge-complete").write_text("done\n")
    assert packaged_model_path(folder) == folder  # no conversion, no GGUF needed
