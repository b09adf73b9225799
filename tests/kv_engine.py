"""What the engine-instance tests share: a tiny Llama whose greedy output does not loop, a
prompt, and a generate call over the reference engine's HTTP API."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers

from tensorcast.engine.server import engine_request

LLAMA = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.6,  # large: with the default 0.02 greedy output loops on a few tokens
)
PROMPT = [random.Random(7).randrange(128) for _ in range(37)]


def save_llama(directory: Path) -> Path:
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(directory)
    return directory


def generate(endpoint: str, req_id: str, prompt: list[int] | None, n: int) -> list[int]:
    body = {"req_id": req_id, "prompt_ids": prompt, "max_new_tokens": n}
    return engine_request(endpoint, "POST", "/generate", body)["tokens"]
