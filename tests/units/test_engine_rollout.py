"""Rollouts on a serving engine (forge/core/engine_rollout.py), with a scripted engine in vLLM's place: what Forge
sends (token ids, seeds, budgets, stops) and what it builds of the answers (masks, stops, tool results, the call
limit). The real engine is tested in tests/on_vllm (`make test-vllm`)."""

from __future__ import annotations

import pytest
import torch

from forge.core.engine_rollout import generate_on_engine, request_seeds
from forge.core.rollout import SamplingSettings, sampling_noise
from forge.model.vllm_engine import Sample
from forge.tools.calls import ToolSettings, as_tools, calculator

CALL = "<calc>2+3</calc>"
RESULT = "<result>5</result>"


class ScriptedEngine:
    """Answers every request with the next tokens of `script`, counted from what the request's context already
    holds after its prompt, cut as vLLM cuts: after the first stop token (kept), or at max_tokens."""

    context = 512

    def __init__(self, script: list[int], prompt_length: int, stop_ids: list[int]):
        self.script, self.prompt_length, self.stop_ids = script, prompt_length, stop_ids
        self.requests: list[dict] = []

    def sample(self, prompts, group_size, sampling, seeds, max_tokens=None, stop_ids=None):
        out = []
        for i, prompt in enumerate(prompts):
            self.requests.append({"prompt": list(prompt), "seed": None if seeds is None else seeds[i],
                                  "max_tokens": sampling.max_new_tokens if max_tokens is None else max_tokens[i],
                                  "stops": self.stop_ids if stop_ids is None else stop_ids})
            done = len(prompt) - self.prompt_length  # the completion so far, sampled and fed
            group = []
            for _ in range(group_size):
                tokens, stopped = [], False
                for token in self.script[done:]:
                    if len(tokens) == self.requests[-1]["max_tokens"]:
                        break
                    tokens.append(token)
                    if token in self.requests[-1]["stops"]:
                        stopped = True
                        break
                group.append(Sample(tokens, [-0.5] * len(tokens), stopped))
            out.append(group)
        return out


def test_request_seeds_are_each_groups_first_draw():
    noise = torch.tensor([[0.25, 0.9], [0.5, 0.1], [0.75, 0.3], [0.125, 0.6]], dtype=torch.float64)
    assert request_seeds(noise, 2) == [2**60, 3 * 2**60]  # 0.25 * 2**62, 0.75 * 2**62
    assert request_seeds(noise, 1) == [2**60, 2**61, 3 * 2**60, 2**59]


def test_plain_rollout_from_an_engine(tiny_tokenizer):
    prompt_ids = tiny_tokenizer("What is 2 + 3?")["input_ids"]
    eos = tiny_tokenizer.eos_token_id
    body = tiny_tokenizer(" five", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(body + [eos] + body, len(prompt_ids), [eos])
    noise = sampling_noise(torch.Generator().manual_seed(0), 3, 16)
    rollout = generate_on_engine(engine, tiny_tokenizer, ["What is 2 + 3?"], 3, SamplingSettings(16), noise=noise)
    assert [r["prompt"] for r in engine.requests] == [prompt_ids]  # one request: the group is its n
    assert engine.requests[0]["seed"] == request_seeds(noise, 3)[0]
    length = len(body) + 1
    assert rollout.completion_ids[:, :length].tolist() == [body + [eos]] * 3  # the stop token kept
    assert rollout.completion_mask.sum(dim=1).tolist() == [length] * 3 and not rollout.truncated.any()
    assert torch.equal(rollout.sampler_logprobs[:, :length], torch.full((3, length), -0.5))
    assert rollout.completions == [" five"] * 3


def test_tool_calls_on_an_engine_feed_the_result_as_tokens_and_mask_it(tiny_tokenizer):
    tools = ToolSettings(as_tools([calculator]))
    prompt_ids = tiny_tokenizer("What is 2 + 3?")["input_ids"]
    call = tiny_tokenizer(CALL, add_special_tokens=False)["input_ids"]
    result = tiny_tokenizer(RESULT, add_special_tokens=False)["input_ids"]
    after = tiny_tokenizer(" so 5", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    # what the model "samples": the call, then (after the fed result) its answer; the script is indexed by the
    # completion so far, so the result's positions hold what the engine would never be asked to sample
    engine = ScriptedEngine(call + [0] * len(result) + after, len(prompt_ids), [tiny_tokenizer.eos_token_id])
    rollout = generate_on_engine(engine, tiny_tokenizer, ["What is 2 + 3?"], 2, SamplingSettings(40),
                                 noise=sampling_noise(torch.Generator().manual_seed(1), 2, 40), tools=tools)
    expected = call + result + after
    for row in range(2):
        length = int(rollout.completion_lengths[row])
        assert rollout.completion_ids[row, :length].tolist() == expected
        assert rollout.action_mask[row, :length].tolist() == [1] * len(call) + [0] * len(result) + [1] * len(after)
        assert [r.output for r in rollout.tool_calls[row]] == ["5"]
        assert float(rollout.sampler_logprobs[row, len(call):len(call) + len(result)].abs().sum()) == 0
    assert not rollout.truncated.any()
    # token in: every request's context is the prompt and the completion so far, ids as sampled and fed (a
    # request also stops at tokens that may close a call, like the '>' of '<calc>', and goes on from there)
    for request in engine.requests:
        so_far = request["prompt"][len(prompt_ids):]
        assert request["prompt"] == prompt_ids + expected[:len(so_far)]
        fed = len(result) if len(so_far) >= len(call) + len(result) else 0
        assert request["max_tokens"] == 40 - (len(so_far) - fed)  # only sampled tokens count
        assert tiny_tokenizer.eos_token_id in request["stops"]
    assert any(r["prompt"] == prompt_ids + call + result for r in engine.requests)


def test_the_call_limit_ends_an_engine_completion(tiny_tokenizer):
    tools = ToolSettings(as_tools([calculator]), max_calls=1)
    prompt_ids = tiny_tokenizer("Go")["input_ids"]
    calls = tiny_tokenizer(CALL + CALL, add_special_tokens=False)["input_ids"]
    one = len(tiny_tokenizer(CALL, add_special_tokens=False)["input_ids"])
    result = len(tiny_tokenizer(RESULT, add_special_tokens=False)["input_ids"])
    engine = ScriptedEngine(calls[:one] + [0] * result + calls[one:] + [7] * 20, len(prompt_ids), [2])
    rollout = generate_on_engine(engine, tiny_tokenizer, ["Go"], 2, SamplingSettings(30), tools=tools)
    assert [len(c) for c in rollout.tool_calls] == [1, 1]
    assert not rollout.truncated.any()  # ended by the call limit, not by the budget
    assert int(rollout.completion_lengths[0]) == 2 * one + result  # nothing sampled after the unanswered call


@pytest.mark.parametrize("max_new_tokens", [5, 9])
def test_an_engine_completion_that_never_stops_is_truncated_at_its_budget(tiny_tokenizer, max_new_tokens):
    prompt_ids = tiny_tokenizer("Go")["input_ids"]
    engine = ScriptedEngine([7] * 50, len(prompt_ids), [2])
    plain = generate_on_engine(engine, tiny_tokenizer, ["Go"], 2, SamplingSettings(max_new_tokens))
    tools = generate_on_engine(engine, tiny_tokenizer, ["Go"], 2, SamplingSettings(max_new_tokens),
                               tools=ToolSettings(as_tools([calculator])))
    for rollout in (plain, tools):
        assert rollout.truncated.all() and rollout.completion_lengths.tolist() == [max_new_tokens] * 2


class _Answers:
    """A loopback HTTP server standing in for `forge vllm-serve`: /health answers 200, /inference/v1/generate
    answers `body`."""

    def __init__(self, body: bytes):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("body, says", [(b"<html>busy</html>", "not JSON"),
                                        (b'{"choices": [{"index": 0}]}', "cannot read (KeyError: 'token_ids')")])
def test_a_server_that_answers_garbage_is_named_in_one_line(tmp_path, body, says):
    from forge.core.rollout import SamplingSettings as Settings
    from forge.core.engine_rollout import engine_sampling
    from forge.model.vllm_engine import ServerEngine

    server = _Answers(body)
    try:
        engine = ServerEngine(server.url, [2], torch.float32, 64, tmp_path / "weights", timeout=5)
        with pytest.raises(RuntimeError) as caught:
            engine.sample([[1, 2, 3]], 2, engine_sampling(Settings(4)), None)
    finally:
        server.close()
    assert server.url in str(caught.value) and says in str(caught.value)


def test_a_server_that_is_gone_is_named_in_one_line(tmp_path):
    from forge.core.engine_rollout import engine_sampling
    from forge.model.vllm_engine import ServerEngine

    server = _Answers(b"{}")
    engine = ServerEngine(server.url, [2], torch.float32, 64, tmp_path / "weights", timeout=5)
    server.close()
    with pytest.raises(ConnectionError, match=f"vLLM server {server.url}/inference/v1/generate did not answer"):
        engine.sample([[1, 2, 3]], 2, engine_sampling(SamplingSettings(4)), None)
