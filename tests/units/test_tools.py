"""Tools: the calculator, running calls (errors, timeouts, huge outputs, malformed calls), the call formats,
the multi-turn rollout (tiny model, calls forced by a scripted sampler) and its place in the loss.

The scripted sampler replaces `sample_next_token` inside core/rollout.py: for the first decode steps of a
rollout every sampling row gets the next token of a fixed call text, afterwards the real sampler runs. So each
completion starts with a real call whose result is fed back, and the rest depends on the model (weights that
move change it), which the resume test needs.
"""

import copy
import json
import time
import types
import warnings

import pytest
import torch
from safetensors.torch import load_file

from forge import GRPOConfig, GRPOTrainer
from forge.core import rollout as rollout_module
from forge.core.rollout import SamplingSettings, generate, render_prompt
from forge.model.tiny import build_tiny_model, build_tiny_tokenizer
from forge.tools.calls import (
    ToolCall,
    ToolSettings,
    as_tools,
    calculator,
    call_format,
    load_tools,
    resolve_format,
    run_calls,
)

TEMPERATURE = 0.7
CALL = "<calc>2+3</calc>"
RESULT = "<result>5</result>"


# ----------------------------------------------------------------------------------------------------
# The calculator


@pytest.mark.parametrize(("expression", "expected"), [
    ("745 * 48", "35760"),  # 745 * 48 = 35760
    ("(12 + 30) / 7", "6"),  # 42 / 7 = 6.0, written as an integer
    ("7 / 2", "3.5"),
    ("17 // 5", "3"),
    ("17 % 5", "2"),
    ("2 ** 10", "1024"),
    ("-3 + +4", "1"),
    ("1 / 3", "0.3333333333"),  # 10 significant digits
])
def test_calculator_evaluates_arithmetic(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(("expression", "message"), [
    ("__import__('os').system('echo hi')", "only numbers"),
    ("x + 1", "only numbers"),
    ("(lambda: 1)()", "only numbers"),
    ("[1, 2]", "only numbers"),
    ("True + 1", "only numbers"),  # booleans are not numbers here
    ("2 ** 1000", "power too large"),
    ("9" * 31, "number too large"),  # over 10**30
    ("1" + " + 1" * 60, "longer than 200"),
    ("1 +", "cannot parse"),
])
def test_calculator_refuses_everything_else(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_tool_schema_comes_from_the_signature_and_docstring():
    (tool,) = as_tools([calculator])
    assert tool.name == "calculator" and tool.text_tag == "calc" and tool.parameters == ["expression"]
    assert tool.schema["function"]["parameters"]["required"] == ["expression"]

    def untyped(x):
        """No type hints."""

    with pytest.raises(ValueError, match="type hint on every argument"):
        as_tools([untyped])


# ----------------------------------------------------------------------------------------------------
# Running calls


def boom(text: str) -> str:
    """Always fails.

    Args:
        text: ignored
    """
    raise RuntimeError("the tool broke")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def flood(text: str) -> str:
    """Returns ten megabytes.

    Args:
        text: ignored
    """
    return "x" * 10_000_000


def settings_for(*functions, **limits) -> ToolSettings:
    return ToolSettings(as_tools(list(functions)), **limits)


def test_a_raising_tool_answers_with_its_error():
    (result,) = run_calls([ToolCall("<boom>a</boom>", "boom", {"text": "a"})], settings_for(boom))
    assert result.failure == "error" and result.output == "error: RuntimeError: the tool broke"


def test_a_hanging_tool_times_out_and_calls_run_in_parallel():
    settings = settings_for(sleepy, timeout=0.5)
    started = time.perf_counter()
    results = run_calls([ToolCall("", "sleepy", {"seconds": 0.3}), ToolCall("", "sleepy", {"seconds": 0.3}),
                         ToolCall("", "sleepy", {"seconds": 30})], settings)
    took = time.perf_counter() - started
    assert [r.failure for r in results] == [None, None, "timeout"]
    assert [r.output for r in results[:2]] == ["awake", "awake"]
    assert "longer than 0.5 s" in results[2].output
    assert took < 0.9  # one timeout for the round (serial would be >= 0.3 + 0.3 + 0.5)


def test_a_call_abandoned_in_a_thread_is_said_once_with_the_way_out(monkeypatch):
    from forge.tools import calls

    monkeypatch.setattr(calls, "_abandoned", set())
    settings = settings_for(sleepy, timeout=0.2)
    with pytest.warns(RuntimeWarning, match=r"tool sleepy ran past tool_timeout=0\.2 s and keeps running in a thread "
                                            r".*tool_isolation='process'"):
        run_calls([ToolCall("", "sleepy", {"seconds": 3})], settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per tool
        run_calls([ToolCall("", "sleepy", {"seconds": 3})], settings)
    (worker,) = run_calls([ToolCall("", "sleepy", {"seconds": 0.05})], settings_for(sleepy, isolation="process"))
    assert worker.failure is None  # (a worker past its timeout is killed: nothing to say)


def test_a_huge_output_is_truncated_with_a_marker():
    (result,) = run_calls([ToolCall("", "flood", {"text": ""})], settings_for(flood, max_output_chars=100))
    assert result.truncated and result.failure is None
    assert result.output == "x" * 100 + "... [output truncated: 9999900 more characters]"


def test_malformed_unknown_and_badly_argued_calls_are_answered_with_errors():
    fmt = call_format("text", as_tools([calculator, sleepy]))
    bad_json = fmt.parse("so <sleepy>not json</sleepy>")  # sleepy has one parameter: the text is its argument
    assert bad_json.arguments == {"seconds": "not json"}
    no_open = fmt.parse("2+3</calc>")
    assert no_open.error == "</calc> without an opening <calc>"
    calls = [no_open, ToolCall("", "nope", {}), ToolCall("", "calculator", {"expr": "1"})]
    results = run_calls(calls, settings_for(calculator, sleepy))
    assert [r.failure for r in results] == ["malformed", "unknown_tool", "malformed"]
    assert results[1].output == "error: no tool named 'nope'; the tools are ['calculator', 'sleepy']"
    assert results[2].output == "error: bad arguments for calculator: missing a required argument: 'expression'"


def test_text_and_template_call_parsing():
    text = call_format("text", as_tools([calculator]))
    assert text.parse("first <calc>9</calc> then <calc> 745 * 48 </calc>").arguments == {"expression": "745 * 48"}
    assert text.parse("no call here") is None
    template = _template_tokenizer()
    fmt = call_format("template", as_tools([calculator]), template)
    call = fmt.parse('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2+3"}, None)
    assert "not JSON" in fmt.parse("<tool_call>{name: calculator}</tool_call>").error
    assert fmt.parse('<tool_call>{"arguments": {}}</tool_call>').error.startswith("a call is a JSON object")


def test_a_deeply_nested_json_call_is_a_malformed_call_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000  # json.loads alone raises RecursionError on this
    fmt = call_format("template", as_tools([calculator]), _template_tokenizer())
    call = fmt.parse(f'<tool_call>{{"name": "calculator", "arguments": {{"expression": {deep}}}}}</tool_call>')
    assert call.arguments is None and "nests deeper than" in call.error
    as_string = fmt.parse('<tool_call>{"name": "calculator", "arguments": "' + deep + '"}</tool_call>')
    assert as_string.arguments is None and "nests deeper than" in as_string.error

    def pair(a: str, b: str) -> str:
        """Two arguments.

        Args:
            a: one
            b: two
        """
        return a + b

    text = call_format("text", as_tools([pair]))
    call = text.parse(f'<pair>{{"a": {deep}, "b": "x"}}</pair>')
    assert call.arguments is None and "nests deeper than" in call.error
    (result,) = run_calls([call], settings_for(pair))
    assert result.failure == "malformed"


def test_lone_surrogates_in_a_tool_result_are_replaced():
    def broken_bytes(text: str) -> str:
        """Answer with a lone surrogate.

        Args:
            text: anything
        """
        return "caf\udce9 " + text

    (result,) = run_calls([ToolCall("", "broken_bytes", {"text": "x"})], settings_for(broken_bytes))
    assert result.failure is None and result.output == "caf\ufffd x"
    result.output.encode("utf-8")  # what a tokenizer needs


def test_load_tools_for_the_cli(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text('def shout(text: str) -> str:\n    """Upper case.\n\n    Args:\n        text: words\n    """\n'
                    '    return text.upper()\n')
    shout, calc = load_tools(f"{path}:shout,calculator")
    assert shout("hi") == "HI" and calc is calculator
    with pytest.raises(ValueError, match="has no function nothing"):
        load_tools(f"{path}:nothing")
    with pytest.raises(ValueError, match="write module:function"):
        load_tools("just_a_name")


# ----------------------------------------------------------------------------------------------------
# The rollout


def install_script(patch):
    """Patch the rollout's sampler with `patch(owner, name, value)` (monkeypatch.setattr, or setattr in a
    worker process): the first len(script) decode steps of each rollout give every sampling row the script's
    tokens, then the real sampler runs. Returns a function that sets the script's text."""
    state = {"ids": [], "step": 0}
    real_sampler, real_generate = rollout_module.sample_next_token, rollout_module.generate

    def sampler(logits, settings, draws, cdf_out=None):
        step, state["step"] = state["step"], state["step"] + 1
        if step < len(state["ids"]):
            return torch.full((logits.shape[0],), state["ids"][step], dtype=torch.long)
        return real_sampler(logits, settings, draws, cdf_out)

    def counting_generate(*args, **kwargs):
        state["step"] = 0
        return real_generate(*args, **kwargs)

    patch(rollout_module, "sample_next_token", sampler)
    patch(rollout_module, "generate", counting_generate)
    import forge.core.trainer as trainer_module

    patch(trainer_module, "generate", counting_generate)

    def set_script(tokenizer, text):
        state["ids"] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return state["ids"]

    return set_script


@pytest.fixture
def scripted(monkeypatch):
    """The rollout's sampler patched to open every completion with a fixed text (install_script)."""
    return install_script(monkeypatch.setattr)


PROMPTS = ["What is 2 + 3?", "Answer: 19"]


def test_calls_are_answered_and_the_action_mask_marks_exactly_the_result(scripted, tiny_model, tiny_tokenizer):
    call_ids = scripted(tiny_tokenizer, CALL)
    result_ids = tiny_tokenizer(RESULT, add_special_tokens=False)["input_ids"]
    noise = torch.rand(4, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rollout = rollout_module.generate(tiny_model, tiny_tokenizer, PROMPTS, 2, SamplingSettings(20, TEMPERATURE), noise=noise, tools=settings_for(calculator))
    for row in range(4):
        length = int(rollout.completion_lengths[row])
        ids = rollout.completion_ids[row, :length].tolist()
        action = rollout.action_mask[row, :length].tolist()
        # the call, then the result fed back, then the model's own tokens
        assert ids[:len(call_ids) + len(result_ids)] == call_ids + result_ids
        assert action == [1] * len(call_ids) + [0] * len(result_ids) + [1] * (length - len(call_ids) - len(result_ids))
        assert sum(action) <= 20  # max_new_tokens counts the model's tokens only
        assert rollout.completions[row].startswith(CALL + RESULT)
        assert [r.output for r in rollout.tool_calls[row]][:1] == ["5"]
        assert float(rollout.sampler_logprobs[row, len(call_ids):len(call_ids) + len(result_ids)].abs().sum()) == 0
    assert rollout.sampled_mask.sum() < rollout.completion_mask.sum()
    assert (rollout.sampled_mask.sum(dim=1) == 20).any()  # some row ran to its budget of model tokens


def test_without_calls_the_tool_rollout_equals_generate(tiny_model, tiny_tokenizer):
    """No call is made (random tiny model): same tokens, masks and sampler log-probs as generate."""
    noise = torch.rand(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    settings = SamplingSettings(12, TEMPERATURE)
    plain = generate(tiny_model, tiny_tokenizer, PROMPTS, 4, settings, noise=noise)
    tools = rollout_module.generate(tiny_model, tiny_tokenizer, PROMPTS, 4, settings, noise=noise, tools=settings_for(calculator))
    width = plain.completion_ids.shape[1]
    assert all(len(calls) == 0 for calls in tools.tool_calls)
    assert torch.equal(tools.completion_mask, plain.completion_mask[:, :tools.completion_mask.shape[1]])
    mask = plain.completion_mask.bool()
    assert torch.equal(tools.completion_ids[:, :width][mask[:, :tools.completion_ids.shape[1]]],
                       plain.completion_ids[mask])
    torch.testing.assert_close(tools.sampler_logprobs[:, :width], plain.sampler_logprobs[:, :tools.sampler_logprobs.shape[1]])
    assert torch.equal(tools.truncated, plain.truncated) and tools.truncated.any() is not None


def test_the_call_limit_ends_the_completion(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, "<calc>1+</calc><calc>2*3</calc><calc>4</calc> more")
    rollout = rollout_module.generate(tiny_model, tiny_tokenizer, PROMPTS[:1], 1, SamplingSettings(60, TEMPERATURE), tools=settings_for(calculator, max_calls=2))
    text, calls = rollout.completions[0], rollout.tool_calls[0]
    assert text == ("<calc>1+</calc><result>error: ValueError: cannot parse '1+' as arithmetic</result>"
                    "<calc>2*3</calc><result>6</result><calc>4</calc>")  # the third call ends it, unanswered
    assert [c.failure for c in calls] == ["error", None]
    assert not rollout.truncated[0]


def test_no_call_limit_answers_every_call(scripted, tiny_model, tiny_tokenizer):
    """max_calls=None, TRL's max_tool_calling_iterations=None: no limit but the completion's tokens."""
    scripted(tiny_tokenizer, "<calc>1+</calc><calc>2*3</calc><calc>4</calc> more")
    rollout = rollout_module.generate(tiny_model, tiny_tokenizer, PROMPTS[:1], 1, SamplingSettings(60, TEMPERATURE),
                                      tools=settings_for(calculator, max_calls=None))
    assert [c.failure for c in rollout.tool_calls[0]] == ["error", None, None]  # the third call answered too
    assert "<calc>4</calc><result>4</result>" in rollout.completions[0]


def test_the_prompt_is_computed_once_per_group(scripted, tiny_model, tiny_tokenizer):
    scripted(tiny_tokenizer, CALL)
    batches = []
    tiny_model.model.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    rollout_module.generate(tiny_model, tiny_tokenizer, PROMPTS, 4, SamplingSettings(10, TEMPERATURE), tools=settings_for(calculator))
    multi_token = [shape for shape in batches if shape[1] > 1]
    assert multi_token and all(rows == len(PROMPTS) for rows, _ in multi_token)  # prefill: 2 prompts, not 8
    assert all(length == 1 for _, length in batches[1:])  # results are fed in the decode steps, one token each


def _template_tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{#- a Qwen-like tool template: calls are <tool_call>{json}</tool_call> -#}"
        "{% if tools %}<|system|>tools: {{ tools | tojson }}</s>{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}"
        "</tool_response></s>{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tokenizer


def test_template_protocol_feeds_the_tool_message(scripted):
    tokenizer = _template_tokenizer()
    model, _ = build_tiny_model(tokenizer, seed=0)
    assert resolve_format("auto", tokenizer) == "template"
    assert resolve_format("auto", build_tiny_tokenizer()) == "text"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    scripted(tokenizer, call)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    rollout = rollout_module.generate(model, tokenizer, [prompt], 1, SamplingSettings(120, TEMPERATURE), tools=settings_for(calculator, format="template"))
    assert "tools: [" in render_prompt(tokenizer, prompt, [t.schema for t in as_tools([calculator])])
    assert '"calculator"' in tokenizer.decode(rollout.prompt_ids[0])  # the schema reached the prompt
    fed = rollout.completion_ids[0][(rollout.action_mask[0] == 0) & (rollout.completion_mask[0] == 1)]
    # the end of the assistant turn, the tool message, the start of the next assistant turn (EOS inside is fed,
    # so it does not end the completion)
    assert tokenizer.decode(fed) == "</s><|user|><tool_response>5</tool_response></s><|assistant|>"
    assert rollout.tool_calls[0][0].output == "5"


# ----------------------------------------------------------------------------------------------------
# The trainer: loss mask, log-probs of interleaved sequences, rewards, metrics, resume


def calls_reward(prompts, completions, tool_calls, **kwargs):
    """Varies in a group; checks it sees the transcript and the calls."""
    assert all(text.startswith(CALL + RESULT) for text in completions)
    assert all(calls[0]["output"] == "5" and calls[0]["name"] == "calculator" for calls in tool_calls)
    return [len(text) % 5 / 4 for text in completions]


def tool_trainer(tmp_path, mode="full", **overrides):
    model, tokenizer = build_tiny_model(seed=0)
    values = {"group_size": 4, "prompts_per_step": 2, "gradient_accumulation_steps": 1, "max_new_tokens": 24,
              "learning_rate": 1e-2, "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 0, "shuffle": False,
              "max_steps": 2, "temperature": TEMPERATURE, "output_dir": str(tmp_path / "run"),
              "use_lora": mode == "lora", "lora_r": 4, "lora_alpha": 8}
    return GRPOTrainer(model, tokenizer, calls_reward, GRPOConfig(**(values | overrides)), tools=[calculator])


ROWS = [{"prompt": "What is 2 + 3?", "reference": "5"}, {"prompt": "Answer: 19", "reference": "19"}]


def test_the_loss_mask_excludes_exactly_the_tool_tokens(scripted, tmp_path):
    trainer = tool_trainer(tmp_path)
    scripted(trainer.tokenizer, CALL)
    batch, _ = trainer.collect(ROWS)
    (rollout,), (mask,) = batch.rollouts, batch.loss_mask
    result_ids = trainer.tokenizer(RESULT, add_special_tokens=False)["input_ids"]
    start = len(trainer.tokenizer(CALL, add_special_tokens=False)["input_ids"])
    assert torch.equal(mask[:, start:start + len(result_ids)], torch.zeros(8, len(result_ids), dtype=torch.long))
    expected = rollout.completion_mask.clone()
    expected[:, start:start + len(result_ids)] = 0
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_interleaved_logprobs_and_loss_equal_a_per_completion_computation(scripted, tmp_path, mode):
    """The optimised path (shared prompt cache, micro-batches splitting groups, a small log-softmax chunk) gives
    the log-probs of a plain forward of each unpadded prompt + interleaved completion; the loss of one update
    (grpo aggregation, KL) counts the model's tokens only."""
    kl_beta = 0.1
    trainer = tool_trainer(tmp_path, mode, micro_batch_size=3, logprob_chunk_size=5, kl_beta=kl_beta,
                           max_grad_norm=0.0)
    with torch.no_grad():  # move the policy off the reference so the KL term is not trivially 0
        generator = torch.Generator().manual_seed(2)
        for parameter in trainer.trainable:
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    scripted(trainer.tokenizer, CALL)
    batch, _ = trainer.collect(ROWS)
    (rollout,), (mask,), (advantages,), (ref_logprobs,) = (batch.rollouts, batch.loss_mask, batch.advantages,
                                                          batch.ref_logprobs)
    model, tokenizer = trainer.model, trainer.tokenizer
    hand_terms = []
    for row in range(8):
        prompt_ids = tokenizer(render_prompt(tokenizer, ROWS[row // 4]["prompt"]))["input_ids"]
        length = int(rollout.completion_lengths[row])
        completion = rollout.completion_ids[row, :length]
        ids = torch.cat([torch.tensor(prompt_ids), completion])[None]  # (1, Lp + length)
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1] / TEMPERATURE  # (length, V)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, completion[:, None]).squeeze(1)  # (length,)
        fast = trainer.logprobs(model, rollout, torch.tensor([row]))[0, :length]
        torch.testing.assert_close(fast, logprobs.detach(), rtol=0, atol=1e-5)
        with torch.no_grad():
            if mode == "lora":
                with model.disable_adapter():
                    ref_logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1] / TEMPERATURE
            else:
                ref_logits = trainer.reference_model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1] / TEMPERATURE
        ref = torch.log_softmax(ref_logits.float(), dim=-1).gather(1, completion[:, None]).squeeze(1)
        torch.testing.assert_close(ref_logprobs[row, :length], ref, rtol=0, atol=1e-5)
        sampled = rollout.action_mask[row, :length].bool()
        # DeepSeekMath eq. 3 on the model's tokens only: -A * ratio (= 1) + beta * k3 KL, mean over the row
        per_token = -float(advantages[row]) * torch.exp(logprobs - logprobs.detach()) + kl_beta * (
            torch.exp(ref - logprobs) - (ref - logprobs) - 1)
        hand_terms.append(per_token[sampled].mean())
        assert int(mask[row].sum()) == int(sampled.sum()) < length
    hand_loss = torch.stack(hand_terms).mean()
    captured = {}
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    trainer.optimizer.step = types.MethodType(lambda optimizer: captured.update(
        {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}), trainer.optimizer)
    loss = trainer.update(batch)["loss"]
    assert loss == pytest.approx(float(hand_loss), rel=1e-5, abs=1e-7)
    model.zero_grad(set_to_none=True)
    hand_loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            scale = parameter.grad.abs().max().clamp(min=1e-3)
            torch.testing.assert_close(captured[name] / scale, parameter.grad / scale, rtol=0, atol=1e-5, msg=name)


def test_tool_metrics_samples_and_bitwise_resume(scripted, tmp_path):
    def run(resume_from=None):
        trainer = tool_trainer(tmp_path, max_steps=3, save_steps=1, resume_from=resume_from)
        scripted(trainer.tokenizer, CALL)
        if resume_from:
            with pytest.warns(UserWarning, match="holds later checkpoints"):
                trainer.train(ROWS * 3)
        else:
            trainer.train(ROWS * 3)
        return load_file(tmp_path / "run" / "final" / "model.safetensors")

    straight = run()
    log = [json.loads(line) for line in (tmp_path / "run" / "training_log.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert log[0]["tools/call_frequency"] >= 1.0 and log[0]["tools/frac_completions_with_call"] == 1.0
    assert log[0]["tools/errors"] == log[0]["tools/timeouts"] == log[0]["tools/malformed"] == 0
    assert log[0]["tools/result_tokens_mean"] >= len(build_tiny_tokenizer()(RESULT)["input_ids"])
    assert samples[0]["tool_calls"][0] == {"name": "calculator", "arguments": {"expression": "2+3"},
                                           "call": CALL, "output": "5", "failure": None, "truncated": False}
    expected = copy.deepcopy(straight)
    resumed = run(resume_from=str(tmp_path / "run" / "checkpoint-1"))
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)
    assert any(not torch.equal(resumed[k], build_tiny_model(seed=0)[0].state_dict()[k]) for k in expected)


def test_tools_never_called_in_the_first_three_steps_are_warned_about_once(tmp_path, scripted):
    model, tokenizer = build_tiny_model(seed=0)
    config = GRPOConfig(group_size=4, prompts_per_step=2, gradient_accumulation_steps=1, max_steps=4, save_steps=0,
                        max_new_tokens=6,  # too few for a whole call: <calc>2+3</calc> is 14 tiny-tokenizer tokens
                        output_dir=str(tmp_path / "silent"))
    silent = GRPOTrainer(model, tokenizer, lambda prompts, completions, **kw: [len(c) % 3 for c in completions],
                         config, tools=[calculator])
    with pytest.warns(UserWarning, match=r"no completion called a tool in the first 3 steps .* the prompts likely "
                                         r"do not teach the call format.*docs/tools.md") as caught:
        silent.train(ROWS * 4)
    assert sum("called a tool" in str(w.message) for w in caught) == 1
    calling = tool_trainer(tmp_path / "calling", max_steps=3)
    scripted(calling.tokenizer, CALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calling.train(ROWS * 3)
    assert not [w for w in caught if "called a tool" in str(w.message)]


def test_forge_train_with_tools_on_the_command_line(tmp_path):
    from forge.cli import main as forge_main

    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    args = ["train", "--model", str(tmp_path / "tiny"), "--dataset", str(tmp_path / "data.jsonl"),
            "--reward", "length", "--group_size", "2", "--prompts_per_step", "2", "--max_new_tokens", "4",
            "--max_steps", "1", "--logging_steps", "1", "--tools", "calculator", "--max_tool_calling_iterations",
            "2"]
    assert forge_main([*args, "--output_dir", str(tmp_path / "run")]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "training_log.jsonl").read_text().splitlines()]
    assert "tools/call_frequency" in row  # the random tiny model makes no call, but the tool loop ran
    assert forge_main([*args, "--output_dir", str(tmp_path / "bad"), "--tools", "nowhere"]) != 0


def test_a_closer_merged_with_the_next_characters_in_one_token(scripted):
    """BPE often makes '><' one token ('</calc><result>' in a worked example): the call still ends there, and
    since the model began the result's '<' itself, only the rest of '<result>5</result>' is fed."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["><"])
    model, _ = build_tiny_model(tokenizer, seed=0)
    merged = tokenizer.convert_tokens_to_ids("><")
    ids = tokenizer("<calc>2+3</calc", add_special_tokens=False)["input_ids"] + [merged]
    scripted(tokenizer, "<calc>2+3</calc").append(merged)  # the list the patched sampler reads
    rollout = rollout_module.generate(model, tokenizer, PROMPTS[:1], 1, SamplingSettings(30, TEMPERATURE), tools=settings_for(calculator))
    length = int(rollout.completion_lengths[0])
    assert rollout.completion_ids[0, :len(ids)].tolist() == ids
    fed = rollout.completion_ids[0, :length][rollout.action_mask[0, :length] == 0]
    assert tokenizer.decode(fed) == "result>5</result>"
    assert rollout.completions[0].startswith("<calc>2+3</calc><result>5</result>")


def test_tool_demo_problems_prompt_and_rewards():
    from forge.demo_tools import HELDOUT_SEED, answer_correct, answer_format, tool_problems, tool_rows

    heldout = tool_problems(240, HELDOUT_SEED)
    assert heldout == tool_problems(240, HELDOUT_SEED)  # fixed
    assert [p["kind"] for p in heldout[:3]] == ["product", "boxes", "two_step"]
    two_step = heldout[2]
    a, b, c = (int(x) for x in __import__("re").findall(r"\d+", two_step["question"])[:3])
    assert two_step["answer"] == a * b + c  # bags x apples + single apples; the workers are a distractor
    (row,) = tool_rows(heldout[:1])
    assert "<calc>expression</calc>" in row["prompt"][0]["content"] and row["reference"] == str(heldout[0]["answer"])
    texts = ["<calc>2*3</calc><result>6</result> <answer>6</answer>", "<calc>2*3</calc><result>6</result>",
             "<answer>5</answer> then <answer>6</answer>", "<answer>1,234</answer>"]
    assert answer_correct(None, texts, ["6", "6", "6", "1234"]) == [1.0, 0.0, 1.0, 1.0]  # a <result> alone: 0
    assert answer_format(None, texts) == [1.0, 0.0, 1.0, 1.0]


# ----------------------------------------------------------------------------------------------------
# Two processes with tools

TOOL_REWARD_FILE = '''
def calls_reward(prompts, completions, tool_calls, **kwargs):
    assert all(calls and calls[0]["output"] == "5" for calls in tool_calls)
    return [len(text) % 5 / 4 for text in completions]
'''

TOOL_DRIVER_FILE = '''
import sys
sys.path.insert(0, {tests_dir!r})
from test_tools import CALL, install_script
from forge.cli import main
from forge.model.tiny import build_tiny_tokenizer

install_script(setattr)(build_tiny_tokenizer(), CALL)
sys.exit(main(sys.argv[1:]))
'''


def one_and_two_processes(tmp_path, args: list[str]) -> tuple[list, list, dict, dict]:
    """`forge train *args` in this process (output one/) and under `torch.distributed.run --nproc_per_node 2`
    through tmp_path/driver.py (output two/): (samples of one, samples of two, final weights of one, of two)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from forge.cli import main as forge_main

    assert forge_main([*args, "--output_dir", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "driver.py"), *args, "--output_dir", str(tmp_path / "two")], env=env,
                          check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    one, two = ([json.loads(line) for line in (tmp_path / run / "samples.jsonl").read_text().splitlines()]
                for run in ("one", "two"))
    expected, got = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("one", "two"))
    return one, two, expected, got


def test_two_processes_with_tools_give_the_completions_and_weights_of_one(scripted, tmp_path):
    """`torch.distributed.run --nproc_per_node 2` of `forge train --tools calculator` vs the same in this
    process: every completion opens with a call that is answered, then samples on; the ranks split the prompts
    and the noise, so the transcripts (tool results included) and the trained weights are those of one process."""
    from pathlib import Path


    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    rows = [{"prompt": f"What is {a} + 3?", "reference": str(a + 3)} for a in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(TOOL_REWARD_FILE)
    tests_dir = Path(__file__).parent
    (tmp_path / "driver.py").write_text(TOOL_DRIVER_FILE.format(tests_dir=str(tests_dir)))
    args = ["train", "--model", str(tmp_path / "tiny"), "--dataset", str(tmp_path / "data.jsonl"),
            "--reward", f"{tmp_path / 'rewards.py'}:calls_reward", "--group_size", "4", "--prompts_per_step", "2",
            "--gradient_accumulation_steps", "1", "--max_new_tokens", "24", "--max_steps", "2", "--logging_steps", "1", "--log_completions", "8",
            "--learning_rate", "0.01", "--temperature", str(TEMPERATURE), "--tools", "calculator", "--seed", "3",
            "--save_steps", "0"]
    scripted(tokenizer, CALL)
    one, two, expected, got = one_and_two_processes(tmp_path, args)
    assert one == two and len(one) == 4  # one transcript per group, 2 groups a step (one per rank)
    assert all(RESULT in json.dumps(sample) for sample in one)  # every transcript holds the tool's answer
    for name, value in expected.items():
        assert torch.allclose(got[name], value, rtol=1e-4, atol=1e-6), name
    start = build_tiny_model(seed=0)[0].state_dict()
    assert any(not torch.equal(expected[k], start[k]) for k in expected)
