"""Sampling on vLLM (`generation_backend="vllm"`): an engine inside the training process (`colocate`) or a
`forge vllm-serve` server in another one (`server`), behind one interface:

    engine.sample(prompts, group_size, sampling, seeds) -> group_size Samples per prompt, token in / token out
    engine.sync(model, version)                          -> the policy's current weights, pushed when changed

The engine never sees text: prompts go in as the token ids Forge rendered, completions come back as the
sampled ids with their log-probs under the sampling softmax (vLLM's `processed_logprobs`: logits /
temperature, and with top_k / top_p the renormalised truncated distribution), so the trainer's log-probs and
the rollout importance weights compare the same tokens. Each prompt's group is one request with its own seed,
so a step's samples are a function of the weights, the prompts and (seed, step): a resumed run draws what the
uninterrupted one drew.

Weights: the engine starts from the policy's weights as they are (a model Forge loaded from a GGUF file has no
folder: they are written once to a temporary one), and after each optimizer step it receives the policy's
named weights in the checkpoint's names (LoRA: W + s B A formed in fp32, cast to the engine's dtype), then
drops its prefix cache, which holds keys and values of the old weights.

vLLM is optional: GRPOConfig.validate() refuses generation_backend='vllm' without it, with the line to install
it, before any model loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from forge.logging.logger import note
from forge.model.decode_plan import merged_adapters
from forge.model.lora import is_peft_model

MODES = ("colocate", "server")


@dataclass
class Sample:
    """One completion as the engine sampled it."""

    token_ids: list[int]  # (T,) sampled tokens, the stop token included when it ended on one
    logprobs: list[float]  # (T,) log-prob of each under the sampling softmax
    stopped: bool  # ended on a stop token (False: cut at max_tokens)


@dataclass(frozen=True)
class EngineSampling:
    """What one generation asks of the engine (GRPOConfig's sampling fields, or greedy for evaluation)."""

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


# ----------------------------------------------------------------------------------------------------
# The policy's weights, named as in its checkpoint


@contextlib.contextmanager
def checkpoint_weights(model: nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's weights as (checkpoint name, tensor), LoRA adapters folded in (W + s B A in fp32), valid
    inside the block. A LoRA model whose adapters cannot be merged (DoRA, quantised layers) is refused."""
    with merged_adapters(model, rounded=True) as merged:
        if is_peft_model(model) and not merged:
            raise ValueError(
                "generation_backend='vllm' with LoRA needs plain LoRA adapters on linear layers (no "
                "DoRA, no quantised or sharded weights): their merged weights are what vLLM samples"
            )
        base = model.get_base_model() if is_peft_model(model) else model
        yield [(name.replace(".base_layer.", "."), p.detach()) for name, p in base.named_parameters()
               if "lora_" not in name]


def save_weights(model: nn.Module, file: Path, dtype: torch.dtype) -> None:
    """The policy's checkpoint_weights in `dtype`, as one safetensors file."""
    with checkpoint_weights(model) as weights:
        save_file({name: t.to(dtype).contiguous().clone() for name, t in weights}, str(file))


def write_model_folder(model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """The policy as a model folder vLLM can start from: config, generation config and weights (no tokenizer:
    the engine works on token ids)."""
    (model.get_base_model() if is_peft_model(model) else model).config.save_pretrained(folder)
    save_weights(model, folder / "model.safetensors", dtype)


def kv_cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in every layer."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize


def engine_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype the engine holds the weights in: the run's compute dtype (bf16, fp16), else fp32."""
    return compute if compute in (torch.bfloat16, torch.float16) else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16', 'float16' or 'float32': vLLM's name of a torch dtype."""
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------
# colocate: an engine inside this process


class PushTimer:
    """What both engines count of their weight pushes: how many, and the seconds not yet reported."""

    pushes: int = 0
    push_seconds: float = 0.0

    def take_push_seconds(self) -> float:
        """Seconds spent pushing weights since the last call (a step's metric `vllm/push_seconds`)."""
        seconds, self.push_seconds = self.push_seconds, 0.0
        return seconds


class ColocatedEngine(PushTimer):
    """vLLM's LLM in this process, started from the policy's weights; pushes go straight into
    its model runner."""

    def __init__(self, model: nn.Module, compute: torch.dtype, stop_ids: list[int], *, max_rows: int,
                 max_new_tokens: int, context: int, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.3, seed: int = 0):
        # The engine in this process (not vLLM's engine-core subprocess), so its model runner takes the pushed
        # tensors directly; on a CPU its KV cache is sized for this run unless VLLM_CPU_KVCACHE_SPACE says.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # its INFO and per-push warnings would fill a console
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        device = next(model.parameters()).device
        dtype = engine_dtype(compute)
        if device.type == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            base = model.get_base_model() if is_peft_model(model) else model
            # a step's rows with prompts of up to 1,024 tokens at once, and at least one request of the whole
            # context (vLLM refuses to start otherwise); longer prompts wait for room, they do not fail
            tokens = max(max_rows * (max_new_tokens + 1024), context)
            needed = kv_cache_bytes_per_token(base.config, dtype) * tokens * 5 // 4
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-needed // 2**30)))  # whole GiB
        self.stop_ids, self.version, self.dtype, self.context = list(stop_ids), None, dtype, context
        folder = Path(tempfile.mkdtemp(prefix="forge-vllm-"))
        started = time.perf_counter()
        try:
            write_model_folder(model, folder, dtype)
            from vllm import LLM

            self.llm = LLM(
                model=str(folder),
                skip_tokenizer_init=True,
                dtype=dtype_name(dtype),
                seed=seed,
                enforce_eager=enforce_eager,
                max_model_len=context,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                enable_prefix_caching=True,
                **({"gpu_memory_utilization": gpu_memory_utilization} if device.type == "cuda" else {}),
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        note(f"vLLM engine started in {time.perf_counter() - started:.1f} s ({dtype_name(dtype)}, "
             f"{'eager' if enforce_eager else 'compiled'}, in this process)")

    def sync(self, model: nn.Module, version: int) -> None:
        """Push the policy's weights when `version` (the optimizer step) differs from the last one pushed."""
        if version == self.version:
            return
        if self.version is not None or version != 0:  # the engine started from these weights at step 0
            started = time.perf_counter()
            with checkpoint_weights(model) as weights:
                self.llm.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_iterator": ((name, t.to(self.dtype)) for name, t in weights)},
                )  # the engine's dtype
            self.pushes += 1
            self.push_seconds += time.perf_counter() - started
        self.llm.reset_prefix_cache()  # cached prompt keys/values were computed with the old weights
        self.version = version

    def sample(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: EngineSampling,
        seeds: list[int] | None,
        max_tokens: list[int] | None = None,
        stop_ids: list[int] | None = None,
    ) -> list[list[Sample]]:
        """group_size Samples for each prompt (token ids); max_tokens and stop_ids per call override
        sampling's max_new_tokens and the run's stop tokens (a tool rollout stops where a
        call may end, too)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                **request_params(
                    sampling,
                    group_size,
                    self.stop_ids if stop_ids is None else stop_ids,
                    None if seeds is None else seeds[i],
                    None if max_tokens is None else max_tokens[i],
                )
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        return [
            [
                as_sample(c.token_ids, c.logprobs, c.finish_reason)
                for c in sorted(o.outputs, key=lambda c: c.index)
            ]
            for o in outputs
        ]


def request_params(sampling: EngineSampling, group_size: int, stop_ids: list[int], seed: int | None,
                   max_tokens: int | None = None) -> dict:
    """vLLM SamplingParams for one prompt's group: n completions, the sampled token's
    log-prob, Forge's stops."""
    return {"n": group_size, "max_tokens": sampling.max_new_tokens if max_tokens is None else max_tokens,
            "seed": seed, "logprobs": 0, "stop_token_ids": stop_ids, "detokenize": False,
            "skip_special_tokens": False, "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "top_p": 1.0 if sampling.greedy else sampling.top_p,
            "top_k": 0 if sampling.greedy else max(sampling.top_k, 0)}


def as_sample(token_ids, logprobs, finish_reason: str | None) -> Sample:
    """A vLLM completion (ids, per-position {id: Logprob}) as a Sample."""
    ids = list(token_ids)
    values = [float(position[token].logprob) for position, token in zip(logprobs or [], ids)]
    if len(values) != len(ids):
        raise RuntimeError(f"vLLM returned {len(values)} log-probs for {len(ids)} tokens; run it with "
                           f"logprobs_mode='processed_logprobs' and max_logprobs >= 0")
    return Sample(ids, values, finish_reason == "stop")


# ----------------------------------------------------------------------------------------------------
# server: `forge vllm-serve` in another process (another GPU, or another machine sharing a folder)


PUSHED_WEIGHTS = "vllm-weights"  # output_dir/PUSHED_WEIGHTS: the policy's weights a vLLM server reloads


def drop_pushed_weights(output_dir: str | os.PathLike) -> None:
    """Remove the copy of the policy's weights pushed to a vLLM server (a whole model's size) once a run has
    finished: nothing reads it after the last step, and final/ holds the trained model."""
    shutil.rmtree(Path(output_dir) / PUSHED_WEIGHTS, ignore_errors=True)


def wait_for_health(base_url: str, timeout: float, exited: Callable[[], str | None] = lambda: None) -> None:
    """Return once `base_url`/health answers, asking each second. Raise TimeoutError (the last connection
    error) when `timeout` seconds pass first, or RuntimeError as soon as `exited()` says why the server is
    gone."""
    deadline = time.monotonic() + timeout
    while True:
        if (why := exited()) is not None:
            raise RuntimeError(why)
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            if time.monotonic() > deadline:
                raise TimeoutError(str(getattr(error, "reason", error))) from None
            time.sleep(1.0)


class ServerEngine(PushTimer):
    """A client of `forge vllm-serve` (vLLM's OpenAI-compatible server in development mode):
    token-in/token-out generation on /inference/v1/generate, weights pushed as a safetensors file its workers
    reload from (`reload_weights`), so the server must see `weights_dir` (the same machine, or
    a shared folder)."""

    def __init__(
        self,
        base_url: str,
        stop_ids: list[int],
        compute: torch.dtype,
        context: int,
        weights_dir: str | os.PathLike,
        timeout: float = 240.0,
        pushes: bool = True,
        after_push=None,
    ):
        self.base_url, self.stop_ids, self.version = base_url.rstrip("/"), list(stop_ids), None
        self.pushing, self.after_push = pushes, after_push  # several processes: one pushes, all wait for it
        self.dtype, self.context, self.weights_dir = engine_dtype(compute), context, Path(weights_dir)
        self.wait_until_up(timeout)

    def wait_until_up(self, timeout: float) -> None:
        try:
            wait_for_health(self.base_url, timeout)
        except TimeoutError as error:
            raise ConnectionError(
                f"no vLLM server answered at {self.base_url} within {timeout:.0f} s ({error}); start one "
                "with `forge vllm-serve --model MODEL --port PORT` and set vllm_server_base_url") from None

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        request = urllib.request.Request(f"{self.base_url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"vLLM server {self.base_url}{path}: HTTP {error.code}: "
                               f"{error.read().decode()[:500]}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:  # gone, or hung
            reason = getattr(error, "reason", error)
            raise ConnectionError(f"vLLM server {self.base_url}{path} did not answer: {reason} (is `forge "
                                  f"vllm-serve` still running there?)") from None
        try:
            return json.loads(text) if text else {}
        except ValueError:
            raise RuntimeError(f"vLLM server {self.base_url}{path} answered with something that is not JSON: "
                               f"{text[:200]!r}") from None

    def sync(self, model: nn.Module, version: int) -> None:
        """Write the policy's weights where the server reads them and have its workers reload them."""
        if version == self.version:
            return
        started = time.perf_counter()
        if self.pushing:
            self.weights_dir.mkdir(parents=True, exist_ok=True)
            save_weights(model, self.weights_dir / "model.safetensors.tmp", self.dtype)
            os.replace(self.weights_dir / "model.safetensors.tmp", self.weights_dir / "model.safetensors")
            self.post("/collective_rpc", {"method": "reload_weights",
                                          "kwargs": {"weights_path": str(self.weights_dir)}})
            self.post("/reset_prefix_cache", {})
            self.pushes += 1
        if self.after_push is not None:
            self.after_push()  # no process samples before the step's weights are in
        self.version = version
        self.push_seconds += time.perf_counter() - started

    def sample(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: EngineSampling,
        seeds: list[int] | None,
        max_tokens: list[int] | None = None,
        stop_ids: list[int] | None = None,
    ) -> list[list[Sample]]:
        """As ColocatedEngine.sample, one HTTP request per prompt, sent together."""
        from concurrent.futures import ThreadPoolExecutor

        def one(i: int) -> list[Sample]:
            params = request_params(
                sampling,
                group_size,
                self.stop_ids if stop_ids is None else stop_ids,
                None if seeds is None else seeds[i],
                None if max_tokens is None else max_tokens[i],
            )
            answer = self.post("/inference/v1/generate", {"token_ids": prompts[i], "sampling_params": params})
            try:
                choices = sorted(answer["choices"], key=lambda c: c["index"])
                return [Sample(list(c["token_ids"]), [float(p["logprob"]) for p in c["logprobs"]["content"]],
                               c.get("finish_reason") == "stop") for c in choices]
            except (KeyError, TypeError, ValueError) as error:
                raise RuntimeError(
                    f"vLLM server {self.base_url}/inference/v1/generate answered in a shape Forge "
                    f"cannot read ({type(error).__name__}: {error}): {str(answer)[:200]}"
                ) from None

        with ThreadPoolExecutor(max_workers=min(32, len(prompts) or 1)) as pool:
            return list(pool.map(one, range(len(prompts))))


def serve(
    model_folder: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    enforce_eager: bool = False,
    gpu_memory_utilization: float = 0.9,
    extra: list[str] | None = None,
) -> None:
    """Replace this process with vLLM's OpenAI-compatible server for `forge train --vllm_mode server`: the
    token-in/token-out endpoint on, log-probs of the sampling softmax, and the development endpoints through
    which a trainer has the workers reload its weights (`/collective_rpc`) and drop stale prefixes. Serve only
    on a network you trust: those endpoints take no key. On a CPU the KV cache takes VLLM_CPU_KVCACHE_SPACE
    GiB (4 unless set)."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
            "--host", host, "--port", str(port), "--dtype", dtype, "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-prefix-caching",
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            *(["--enforce-eager"] if enforce_eager else []), *(extra or [])]
    note(f"vllm-serve: {' '.join(argv[1:])}")
    sys.stdout.flush()
    os.execve(sys.executable, argv, env)
