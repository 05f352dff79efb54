"""Tiny randomly initialised causal LMs of several architectures, for fast exactness tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from viasd.kernels.packed_attention import use_packed_attention

ARCHITECTURES = ("llama", "qwen2", "gemma", "gemma2", "qwen3", "llama3", "mistral", "phi3", "gemma3")
# The families viasd's loop runs (passes/loop.py `MIRRORED`); "llama3" is Llama with Llama 3's rope scaling.
LOOP_ARCHITECTURES = ("llama", "qwen2", "qwen3", "llama3", "mistral", "phi3", "gemma3")
# Llama 3.x's rope scaling, with an original context short enough that tiny tests reach past it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # fmt: skip

_CONFIGS = {
    "llama": LlamaConfig,
    "llama3": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "phi3": Phi3Config,
    "gemma": GemmaConfig,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
    "mistral": MistralConfig,
    "mistral-v0.2": MistralConfig,  # full attention, as Mistral 7B from v0.2 on
}


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words t0..t{V-1}; t1 is EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t0")


CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as SmolLM2 and Qwen2.5 use it: the template's own markers are special tokens.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML that offers tools as Qwen2.5's template does (its own wording): the tools as JSON in a system turn, the
# history's calls as <tool_call> JSON objects (arguments rendered as objects), tool results in a user turn.
TOOLS_CHATML_TEMPLATE = (
    '{% if tools %}<|im_start|>system\nCall a function as <tool_call>\n{"name": ..., "arguments": {...}}'
    "\n</tool_call>, one of:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + message.content + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\n' + message.content }}"
    '{% for call in message.tool_calls or [] %}{{ \'\n<tool_call>\n{"name": "\' + call.function.name + '
    "'\", \"arguments\": ' }}{{ call.function.arguments | tojson }}{{ '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Write a Python function that reverses a string.",
    "system user assistant: what is 2+2? It is 4.",
]


def tiny_chat_tokenizer(vocab_size: int = 320, template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes and decodes back) with ChatML special tokens and `template`.

    Ids 0, 1, 2 are <|endoftext|>, <|im_start|>, <|im_end|>; every id is below `vocab_size`.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>"
    )
    wrapped.chat_template = template
    return wrapped


def tiny_model(
    arch: str = "llama",
    *,
    vocab_size: int = 64,
    layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    init_scale: float = 0.3,
    dtype: torch.dtype = torch.float64,
    sliding_window: int | None = None,
    packed: bool = True,
) -> torch.nn.Module:
    """A randomly initialised model; init_scale makes its next-token distributions peaked, not uniform.

    sliding_window: the attention window of the sliding layers (Gemma2 and Gemma3: every other layer, 128 unless
    given; Mistral: all, 4096 unless given).
    packed: attend as loaded CPU models do (`viasd.kernels.packed_attention`); False: transformers' own sdpa.
    """
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=256,
        initializer_range=init_scale,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "gemma2":
        kwargs.update(sliding_window=sliding_window or 128, query_pre_attn_scalar=16)
    elif arch == "gemma3":  # Gemma 3's local and global layers, alternating here (5 to 1 in its checkpoints)
        kinds = ["sliding_attention", "full_attention"] * layers
        kwargs.update(sliding_window=sliding_window or 128, query_pre_attn_scalar=16, layer_types=kinds[:layers])
    elif sliding_window is not None:
        kwargs.update(sliding_window=sliding_window)
    if arch == "mistral-v0.2":
        kwargs.update(sliding_window=None)
    if arch == "llama3":
        kwargs.update(rope_scaling=dict(LLAMA3_ROPE))
    config = _CONFIGS[arch](**kwargs)
    config._attn_implementation = "eager" if arch == "gemma2" else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if packed:
        use_packed_attention(model)
    return model
