"""A tiny random-init Llama and an in-memory BPE tokenizer: offline models for tests and benchmarks."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]

# A ChatML-like template so chat prompts work on the tiny tokenizer too.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "What is 12 + 7? Answer: 19",
    "Solve step by step. <think> 3 times 4 is 12 </think> <answer> 12 </answer>",
    "You are a math reasoning assistant. Solve the problem step by step.",
    "At the end of your solution, write the final answer on its own line in the format: Answer: <number>",
    "Problem: Tom has 5 apples and buys 3 more. How many apples does he have? Solution: 5 + 3 = 8",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 - + * / = ( ) . , ? !",
    "the a an is are was of to in and or not yes no correct wrong number total each",
]


def build_tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer in memory (no download); pad, bos and eos are distinct."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    wrapped.chat_template = TINY_CHAT_TEMPLATE
    return wrapped


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast | None = None,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    dropout: float = 0.0,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer Llama with random weights, seeded, plus its tokenizer. Runs in milliseconds on CPU."""
    tokenizer = tokenizer or build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_dropout=dropout,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(generator_state)
    return model, tokenizer
