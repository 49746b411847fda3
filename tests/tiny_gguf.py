"""Tiny random llama-architecture GGUF files (F32 weights) for llama-backend unit tests.

Written with the ``gguf`` package the way llama.cpp's converter lays out a llama model
(q/k rows permuted back to the interleaved RoPE layout that transformers' GGUF loader undoes),
so the same file loads in both backends and their outputs can be compared.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tiny import VOCAB, byte_tokenizer, tiny_model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # HF rotate-half layout -> GGUF llama (interleaved pairs), as convert_hf_to_gguf.py does
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0, layers: int = 4, hidden: int = 64) -> Path:
    """A random llama model (:func:`tiny.tiny_model`) and the byte tokenizer, as a GGUF file."""
    model = tiny_model("llama", seed, layers=layers, hidden=hidden)
    cfg = model.config
    tok = byte_tokenizer()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(VOCAB)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i == 0 else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges(["a b"])  # llama.cpp needs a merges list; tests tokenize with transformers
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
