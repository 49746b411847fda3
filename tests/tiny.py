"""Tiny random-config targets for fast unit tests (never for quality or speed claims)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

from flashdraft.targets.torch import Target

VOCAB = 64


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0..63 are the words "<eos>", "t1".."t63"."""
    vocab = {"<eos>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 4, hidden: int = 64):
    """A random causal LM of ``arch`` (llama | qwen3) with a peaked output distribution."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  max_position_embeddings=512, eos_token_id=0, pad_token_id=0, bos_token_id=0,
                  tie_word_embeddings=False)
    config = LlamaConfig(**common) if arch == "llama" else Qwen3Config(**common)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # sharper logits so tests see both acceptances and rejections
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def tiny_gemma3(seed: int = 0, layers: int = 4, hidden: int = 64, sliding_window: int = 16):
    """A random Gemma-3-shaped causal LM: scaled embeddings, ``1 + w`` sandwich norms, q/k
    norms, GELU, tied head, sliding-window layers (window ``sliding_window``), BOS = 1."""
    from transformers import Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                              head_dim=hidden // 2, max_position_embeddings=512, eos_token_id=0, pad_token_id=0,
                              bos_token_id=1, sliding_window=sliding_window, tie_word_embeddings=True,
                              query_pre_attn_scalar=hidden // 2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # norms away from their zero init (so 1 + w != w), peaked logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
        model.model.embed_tokens.weight.mul_(0.3)
    return model


def tiny_gemma3_target(seed: int = 0, **kw) -> Target:
    """:func:`tiny_gemma3` as a base model (no chat template) whose tokenizer adds BOS (``t1``)."""
    tok = tiny_tokenizer()
    tok.bos_token = "t1"
    tok.add_bos_token = True
    return Target(tiny_gemma3(seed, **kw), tok, name="tiny-gemma3")


def tiny_target(arch: str = "llama", seed: int = 0, **kw) -> Target:
    return Target(tiny_model(arch, seed, **kw), tiny_tokenizer(), name=f"tiny-{arch}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer over 64 ids: ``<eos>`` (0), space (1, GPT-2's ``Ġ``), a-z, A-Z,
    0-9 (one byte each, no merges): real text for grammar tests on the tiny models."""
    from tokenizers import decoders

    chars = ["Ġ"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    chars += [str(d) for d in range(10)]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars[: VOCAB - 1])}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def tiny_byte_target(arch: str = "llama", seed: int = 0, **kw) -> Target:
    """A tiny random target whose tokens are letters, digits and space."""
    return Target(tiny_model(arch, seed, **kw), byte_tokenizer(), name=f"tiny-bytes-{arch}")
