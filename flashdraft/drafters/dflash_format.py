"""DFlash drafter checkpoints: read and write the SpecForge directory and llama.cpp GGUF layouts.

Canonical in-memory form: ``(config, state_dict)``:
- ``config``: the z-lab / SpecForge ``config.json`` dict (``architectures: ["DFlashDraftModel"]``,
  sizes, ``block_size``, ``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids}``),
  see ``REQUIRED_CONFIG_KEYS``. ``rope_theta`` and ``rope_parameters`` are both filled in on load.
- ``state_dict``: SpecForge weight names (``fc.weight`` [H, k*H], ``hidden_norm.weight`` [H],
  ``norm.weight`` [H], ``layers.N.*``), nn.Linear layout [out, in]; shapes in ``dflash_weight_shapes``.
  No embedding and no LM head: the drafter uses the target's. An optional ``d2t`` is kept as is.

Format sources (read, not copied): z-lab/dflash ``dflash/model.py`` and SpecForge configs
(DESIGN.md §2); the llama.cpp fork converter class ``DFlashDraftModel(TextModel)`` (legacy arch
``dflash-draft``); upstream llama.cpp ``conversion/qwen.py`` class ``DFlashModel(Qwen3Model)``
(arch ``dflash``). What we found there, and rely on:

1. No Q/K row permutation. llama.cpp permutes q/k rows only in ``LlamaModel.modify_tensors``
   (HF rotate_half -> GGML interleaved rope). Both DFlash converter classes derive from
   ``TextModel``/``Qwen3Model``, which do not permute, and are picked by the ``DFlashDraftModel``
   architecture whatever ``model_type`` says; llama.cpp runs them with NEOX rope. Rows copy as is.
2. Norm weights are stored raw (no ``+1`` shift as in the Qwen3-Next / Gemma converters).
3. Upstream ``dflash.target_layers`` is stored **+1**: llama.cpp taps a layer's *input*, and the
   input of layer i+1 is the output of layer i (our ``target_layer_ids``). We add 1 on write and
   subtract 1 on read. The legacy ``dflash-draft.dflash.target_layer_ids`` is stored as is.
   The upstream mask id lives under ``tokenizer.ggml.mask_token_id`` (an early PR used
   ``dflash.mask_token_id``; we read that as a fallback).
4. GGUF lists dims fastest-first (ne0 = in-features), the reverse of PyTorch; we reverse them.
5. GGUF has no place for ``model_type`` or ``num_target_layers``; we write them as
   ``flashdraft.model_type`` / ``flashdraft.num_target_layers`` (llama.cpp ignores unknown keys)
   and fall back to ``"qwen3"`` and ``max(target_layer_ids) + 3`` (exact for z-lab's default spread,
   which ends at layer L-3) for files written by others.
6. llama.cpp (``src/models/dflash.cpp``, ``common/speculative.cpp`` in llama-cpp-python 0.3.36's
   vendored sources) loads the drafter file as a model of its own: it reads the vocabulary and
   the mask id from the file's ``tokenizer.*`` keys and refuses a draft whose vocabulary differs
   from the target's, so upstream's converter copies the target's tokenizer in
   (``--target-model-dir``). With a ``d2t`` it projects with the file's own ``output.weight`` of
   ``V_draft`` rows (the target's LM head would give 49k rows and fail its ``d2t`` size check).
   ``save_gguf(target_gguf=...)`` does both from the target's GGUF: its ``tokenizer.*`` keys and
   its LM head rows ``d2t`` copied raw in the target's own quantisation (our engine projects with
   exactly those rows, ``lm_head.weight[d2t]``). Our loader ignores ``output.weight``.
7. DFlash2 (``architectures: ["DFlash2DraftModel"]``, z-lab ``dflash`` 0.1.0; llama.cpp reads it
   as arch ``dflash`` with ``dflash.{selector_top_k, selector_rank, conv_kernel_size,
   conv_group_size}``): per layer ``layers.N.{attention,mlp}_conv.base_kernel`` [2, kernel, H]
   (GGUF ``blk.N.{attn,ffn}_conv_base``, no ``.weight``) and ``.kernel_projection.weight``
   [2*kernel*H/group, H] (``blk.N.{attn,ffn}_conv_proj.weight``); the selector's
   ``candidate_selector.{predecessor,successor}_codebook`` [V, r] (stored *without*
   ``.weight`` in z-lab's safetensors; GGUF ``selector_{predecessor,successor}.weight``) and
   ``candidate_selector.hidden_projection.weight`` [r, H] (``selector_hidden.weight``).
   llama.cpp packs top_k + top_k² selector scores into one hidden-size row, so it needs
   ``H >= top_k * (top_k + 1)``; there is no legacy ``dflash-draft`` layout.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

ARCHITECTURE = "DFlashDraftModel"
#: a DFlash drafter with DFlash2's convolutions and candidate selector (module note 7)
ARCHITECTURE2 = "DFlash2DraftModel"
DFLASH2_KEYS = ("selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size")
GGUF_ARCHS = ("dflash-draft", "dflash")
REQUIRED_CONFIG_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "vocab_size", "num_hidden_layers", "num_target_layers", "block_size", "attention_bias",
    "tie_word_embeddings", "hidden_act", "dflash_config",
)
# Tensors some checkpoints carry that the drafter never uses: it embeds and projects with the
# target's tables, and t2d only marks which target tokens a reduced draft vocab covers.
_IGNORED = {"embed_tokens.weight", "lm_head.weight", "t2d", "token_embd.weight", "output.weight"}
# SpecForge name inside layers.N -> GGUF name inside blk.N, in both archs; the post-attention
# norm is the one per-layer name they disagree on (_POST_ATTN_NORM).
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_POST_ATTN_NORM = {"dflash-draft": "post_attention_norm", "dflash": "ffn_norm"}
_GLOBAL_NAMES = {
    "dflash-draft": {"fc": "dflash_fc", "hidden_norm": "dflash_hidden_norm", "norm": "output_norm"},
    "dflash": {"fc": "fc", "hidden_norm": "enc.output_norm", "norm": "output_norm"},
}
_GGUF_DTYPES = {  # save_gguf dtype -> (GGML type of matrices, general.file_type)
    torch.float32: (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    torch.float16: (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    torch.bfloat16: (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
_INT_TYPES = {gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16,
              gguf.GGMLQuantizationType.I32, gguf.GGMLQuantizationType.I64}


def validate_dflash_config(config: dict) -> None:
    """Check that ``config`` has every key of the SpecForge DFlash config (``REQUIRED_CONFIG_KEYS``).

    ``rope_theta`` may come as ``rope_parameters["rope_theta"]`` instead.
    Raises ValueError naming the first missing or malformed key.
    """
    for key in REQUIRED_CONFIG_KEYS:
        if key == "rope_theta" and "rope_theta" in (config.get("rope_parameters") or {}):
            continue
        if config.get(key) is None:
            raise ValueError(f"DFlash config is missing required key {key!r}")
    if ARCHITECTURE not in config["architectures"] and ARCHITECTURE2 not in config["architectures"]:
        raise ValueError(f"config 'architectures' is {config['architectures']!r}, "
                         f"expected [{ARCHITECTURE!r}] or [{ARCHITECTURE2!r}]")
    dflash = config["dflash_config"]
    if ARCHITECTURE2 in config["architectures"]:
        for key in DFLASH2_KEYS:
            value = dflash.get(key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"a {ARCHITECTURE2} config needs 'dflash_config.{key}' >= 1, got {value!r}")
        if config["hidden_size"] % dflash["conv_group_size"]:
            raise ValueError(f"'dflash_config.conv_group_size' {dflash['conv_group_size']} does not divide "
                             f"hidden_size {config['hidden_size']}")
    for key in ("mask_token_id", "target_layer_ids"):
        if dflash.get(key) is None:
            raise ValueError(f"DFlash config is missing required key 'dflash_config.{key}'")
    ids = dflash["target_layer_ids"]
    if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"'dflash_config.target_layer_ids' must be a non-empty list of ints >= 0, "
                         f"got {ids!r}")
    if config["attention_bias"]:
        raise ValueError("'attention_bias': true is not supported (DFlash drafters have no biases)")


def dflash_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Expected ``state_dict`` shapes (PyTorch [out, in]) for ``config``, in canonical order."""
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    k = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(config["num_hidden_layers"]):
        for name, shape in {
            "input_layernorm": (h,), "post_attention_layernorm": (h,),
            "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,),
            "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter),
        }.items():
            shapes[f"layers.{n}.{name}.weight"] = shape
    if is_dflash2(config):
        d = config["dflash_config"]
        ks, groups = d["conv_kernel_size"], h // d["conv_group_size"]
        for n in range(config["num_hidden_layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{n}.{conv}.base_kernel"] = (2, ks, h)
                shapes[f"layers.{n}.{conv}.kernel_projection.weight"] = (2 * ks * groups, h)
        r, v = d["selector_rank"], config["vocab_size"]
        shapes["candidate_selector.predecessor_codebook.weight"] = (v, r)
        shapes["candidate_selector.successor_codebook.weight"] = (v, r)
        shapes["candidate_selector.hidden_projection.weight"] = (r, h)
    return shapes


def is_dflash2(config: dict) -> bool:
    """True for a DFlash2 drafter config (``architectures`` names ``DFlash2DraftModel``)."""
    return ARCHITECTURE2 in (config.get("architectures") or [])


def dflash2_config(config: dict, top_k: int, rank: int = 32, conv_kernel: int = 2, conv_group: int = 16) -> dict:
    """``config`` of a DFlash drafter turned into a DFlash2 one (selector top-k/rank, conv
    kernel/group; z-lab's public DFlash2 drafters use kernel 2, group 16, rank 256, top-16)."""
    config = copy.deepcopy(config)
    config["architectures"] = [ARCHITECTURE2]
    config.setdefault("dflash_config", {}).update(selector_top_k=int(top_k), selector_rank=int(rank),
                                                  conv_kernel_size=int(conv_kernel), conv_group_size=int(conv_group))
    return config


def _check_state_dict(config: dict, state_dict: dict, source: str) -> None:
    """Raise ValueError on a missing, unexpected or mis-shaped tensor (``d2t`` is optional)."""
    shapes = dflash_weight_shapes(config)
    for name, shape in shapes.items():
        if name not in state_dict:
            raise ValueError(f"{source}: missing tensor {name!r}")
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(state_dict[name].shape)}, "
                             f"config expects {shape}")
    extra = sorted(set(state_dict) - set(shapes) - {"d2t"})
    if extra:
        raise ValueError(f"{source}: unexpected tensors {extra[:5]} (not part of a DFlash drafter)")


def _normalize_config(config: dict) -> dict:
    """Copy of ``config`` with ``rope_theta``/``rope_parameters`` both set and a nested
    ``block_size`` lifted to the top level (older SpecForge configs keep it in dflash_config)."""
    config = copy.deepcopy(config)
    rope = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if config.get("rope_theta") is not None and not rope:
        config["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    if config.get("block_size") is None and "block_size" in (config.get("dflash_config") or {}):
        config["block_size"] = config["dflash_config"]["block_size"]
    validate_dflash_config(config)
    return config


def load_dflash_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Load a DFlash drafter as ``(config, state_dict)`` in the canonical SpecForge form.

    ``path`` is either a directory with ``config.json`` and ``model.safetensors`` (or a sharded
    ``model.safetensors.index.json``), z-lab/SpecForge layout, where a ``model.`` prefix on
    weight names is tolerated and tensors keep their stored dtype; or a ``.gguf`` file of arch
    ``dflash-draft`` (llama.cpp forks) or ``dflash`` (upstream llama.cpp), whose tensors come
    back as float32 (dequantized from F16/BF16/Q8_0/... with ``gguf.quants``).
    Shapes are listed by ``dflash_weight_shapes(config)``, e.g. ``fc.weight`` [H, k*H].

    Raises FileNotFoundError if ``path`` (or a file the directory needs) does not exist, and
    ValueError on an unknown GGUF arch, a missing config key, or a missing/unexpected/mis-shaped
    tensor.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no DFlash checkpoint at {path}")
    if path.is_dir():
        return _load_specforge(path)
    with open(path, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    if not is_gguf:
        raise ValueError(f"{path} is neither a SpecForge directory nor a GGUF file")
    return _load_gguf(path)


def _load_specforge(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found (a SpecForge drafter directory needs it)")
    config = _normalize_config(json.loads(config_path.read_text()))
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        raise FileNotFoundError(f"neither model.safetensors nor {index.name} in {directory}")
    state_dict = {}
    for shard in shards:
        for name, tensor in load_file(str(directory / shard)).items():
            name = name.removeprefix("model.")
            if name in _CODEBOOKS:  # z-lab stores the selector codebooks without ".weight"
                name += ".weight"
            if name not in _IGNORED:
                state_dict[name] = tensor
    _check_state_dict(config, state_dict, str(directory))
    return config, state_dict


def _gguf_names(arch: str, num_layers: int, dflash2: bool = False) -> dict[str, str]:
    """SpecForge weight name -> GGUF tensor name for ``arch`` (with DFlash2's tensors)."""
    names = {f"{k}.weight": f"{v}.weight" for k, v in _GLOBAL_NAMES[arch].items()}
    for n in range(num_layers):
        for hf, gg in {**_LAYER_NAMES, "post_attention_layernorm": _POST_ATTN_NORM[arch]}.items():
            names[f"layers.{n}.{hf}.weight"] = f"blk.{n}.{gg}.weight"
    names["d2t"] = "d2t"
    if dflash2:
        for n in range(num_layers):
            for hf, gg in (("attention_conv", "attn_conv"), ("mlp_conv", "ffn_conv")):
                names[f"layers.{n}.{hf}.base_kernel"] = f"blk.{n}.{gg}_base"
                names[f"layers.{n}.{hf}.kernel_projection.weight"] = f"blk.{n}.{gg}_proj.weight"
        for hf, gg in (("predecessor_codebook", "predecessor"), ("successor_codebook", "successor"),
                       ("hidden_projection", "hidden")):
            names[f"candidate_selector.{hf}.weight"] = f"selector_{gg}.weight"
    return names


def _f32(value: float) -> float:
    # GGUF stores these as float32; the shortest decimal that round-trips gives 1e-06, not 9.99e-07.
    return float(str(np.float32(value)))


def _load_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    reader = gguf.GGUFReader(path)
    # Skip decoding tokenizer arrays (150k strings for a Qwen3 vocab): only their length is used.
    fields = {name: f.contents() for name, f in reader.fields.items()
              if not name.startswith("tokenizer.") or name.endswith("mask_token_id")}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF arch {arch!r} is not a DFlash drafter (expected one of {GGUF_ARCHS})")

    def meta(key: str, *fallbacks: str):
        for k in (key, *fallbacks):
            if fields.get(k) is not None:
                return fields[k]
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")

    a = arch
    if arch == "dflash-draft":
        block_size = meta("dflash-draft.dflash.block_size")
        mask_token_id = meta("dflash-draft.dflash.mask_token_id")
        target_layer_ids = [int(i) for i in meta("dflash-draft.dflash.target_layer_ids")]
    else:
        block_size = meta("dflash.block_size")
        mask_token_id = meta("tokenizer.ggml.mask_token_id", "dflash.mask_token_id")
        target_layer_ids = [int(i) - 1 for i in meta("dflash.target_layers")]  # stored +1, see note 3
    hidden, heads = meta(f"{a}.embedding_length"), meta(f"{a}.attention.head_count")
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": fields.get("flashdraft.model_type", "qwen3"),
        "hidden_size": hidden,
        "intermediate_size": meta(f"{a}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta(f"{a}.attention.head_count_kv"),
        "head_dim": fields.get(f"{a}.attention.key_length", hidden // heads),
        "rms_norm_eps": _f32(meta(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta(f"{a}.rope.freq_base")),
        "max_position_embeddings": meta(f"{a}.context_length"),
        # Drafter GGUFs often carry the target's tokenizer but no vocab_size; 0 means "the target's".
        "vocab_size": fields.get(f"{a}.vocab_size", len(tokens.data) if tokens else 0),
        "num_hidden_layers": meta(f"{a}.block_count"),
        "num_target_layers": fields.get("flashdraft.num_target_layers", max(target_layer_ids) + 3),
        "block_size": block_size,
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
    }
    if fields.get("flashdraft.ngram_seeded"):
        config["dflash_config"]["ngram_seeded"] = True
    if fields.get(f"{a}.selector_top_k"):
        config["architectures"] = [ARCHITECTURE2]
        config["dflash_config"].update({key: int(meta(f"{a}.{key}")) for key in DFLASH2_KEYS})
    config = _normalize_config(config)
    n_features = fields.get("dflash-draft.dflash.n_target_features")
    if n_features is not None and n_features != len(target_layer_ids) * hidden:
        raise ValueError(f"{path}: n_target_features={n_features} is not "
                         f"{len(target_layer_ids)} target layers x hidden {hidden}")

    to_hf = {g: h for h, g in _gguf_names(arch, config["num_hidden_layers"], is_dflash2(config)).items()}
    state_dict = {}
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        if t.name not in to_hf:
            raise ValueError(f"{path}: unexpected GGUF tensor {t.name!r} for arch {arch!r}")
        state_dict[to_hf[t.name]] = torch.from_numpy(_gguf_tensor_to_numpy(t, path))
    _check_state_dict(config, state_dict, str(path))
    return config, state_dict


def _gguf_tensor_to_numpy(t, path: Path) -> np.ndarray:
    # t.shape is GGUF ne order (fastest dim first): reverse it to get PyTorch's [out, in].
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if t.tensor_type in _INT_TYPES:
        return np.array(t.data).reshape(shape).astype(np.int64)
    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"{path}: cannot dequantize {t.name!r} of type {t.tensor_type.name}") from e
    return np.array(values, dtype=np.float32).reshape(shape)  # copy: the reader's data is a memmap


def save_specforge(out_dir: str | Path, config: dict, state_dict: dict[str, torch.Tensor],
                   dtype: torch.dtype = torch.float16) -> None:
    """Write ``config.json`` + ``model.safetensors`` (z-lab/SpecForge layout, loadable by vLLM/SGLang).

    Floating weights are cast to ``dtype``; ``torch_dtype`` and ``dtype`` in the config say so.
    ``out_dir`` is created if needed. Raises ValueError on a bad config or state_dict.
    """
    config = _normalize_config(config)
    _check_state_dict(config, state_dict, "state_dict")
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")  # "float16"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name.removesuffix(".weight") if name.removesuffix(".weight") in _CODEBOOKS else name:
               (t.to(dtype) if t.is_floating_point() else t).contiguous() for name, t in state_dict.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_gguf(path: str | Path, config: dict, state_dict: dict[str, torch.Tensor],
              arch: str = "dflash-draft", dtype: torch.dtype | str = torch.float16,
              target_gguf: str | Path | None = None) -> None:
    """Write a llama.cpp GGUF of ``arch`` ``"dflash-draft"`` (legacy forks) or ``"dflash"`` (upstream).

    Matrices are stored as ``dtype`` (torch.float32/float16/bfloat16, or ``"q8_0"``; a matrix whose
    rows do not split into Q8_0 blocks of 32 falls back to F16); norm vectors stay F32, ``d2t`` I64.
    ``load_dflash_checkpoint`` reads the file back to the same config fields and tensors (to
    ``dtype`` precision).

    Args:
        target_gguf: the target model's GGUF. Its ``tokenizer.*`` keys are copied in and, for a
            drafter with ``d2t``, its LM head rows ``d2t`` are written as ``output.weight`` in the
            target's own quantisation (module note 6): what llama.cpp's ``draft-dflash`` needs to
            load the file. None: no tokenizer, no head (our engine and the legacy forks take both
            from the target).
    Raises:
        ValueError: an unknown arch or dtype, a bad config or state_dict, or a ``target_gguf``
            whose vocabulary size is not the drafter's ``vocab_size`` or that has no LM head.
        FileNotFoundError: ``target_gguf`` does not exist.
    """
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unknown GGUF arch {arch!r}, expected one of {GGUF_ARCHS}")
    if dtype not in _GGUF_DTYPES:
        raise ValueError(f"unsupported GGUF dtype {dtype!r}, expected one of {list(_GGUF_DTYPES)}")
    config = _normalize_config(config)
    _check_state_dict(config, state_dict, "state_dict")
    dflash2 = is_dflash2(config)
    if dflash2:
        _check_dflash2_for_llama(config, arch)
    target = _TargetParts(target_gguf, config["vocab_size"]) if target_gguf is not None else None
    qtype, file_type = _GGUF_DTYPES[dtype]
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    ids = config["dflash_config"]["target_layer_ids"]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(config.get("_name_or_path") or "dflash-drafter")
    w.add_file_type(file_type)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(head_dim)  # DFlash head_dim need not be hidden / heads
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(config["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_causal_attention(False)  # attention inside the block is bidirectional
    w.add_vocab_size(config["vocab_size"])
    w.add_string("flashdraft.model_type", config["model_type"])
    w.add_uint32("flashdraft.num_target_layers", config["num_target_layers"])
    if config["dflash_config"].get("ngram_seeded"):  # flashdraft's extension; other engines ignore it
        w.add_bool("flashdraft.ngram_seeded", True)
    if arch == "dflash-draft":
        w.add_uint32("dflash-draft.dflash.block_size", config["block_size"])
        w.add_uint32("dflash-draft.dflash.mask_token_id", config["dflash_config"]["mask_token_id"])
        w.add_array("dflash-draft.dflash.target_layer_ids", [int(i) for i in ids])
        w.add_uint32("dflash-draft.dflash.n_target_features", len(ids) * hidden)
    else:
        w.add_uint32("dflash.block_size", config["block_size"])
        w.add_array("dflash.target_layers", [int(i) + 1 for i in ids])  # see module note 3
    if target is not None:
        target.add_tokenizer(w)  # before the mask id: the copy skips the target's own, if any
    if arch == "dflash":
        w.add_mask_token_id(config["dflash_config"]["mask_token_id"])
    if dflash2:
        for key in DFLASH2_KEYS:
            w.add_uint32(f"dflash.{key}", int(config["dflash_config"][key]))

    for name, gguf_name in _gguf_names(arch, config["num_hidden_layers"], dflash2).items():
        if name not in state_dict:
            continue  # only the optional d2t can be absent here
        tensor = state_dict[name].detach().cpu()
        if not tensor.is_floating_point():
            w.add_tensor(gguf_name, tensor.numpy().astype(np.int64))
        elif tensor.ndim == 1 or name.endswith("base_kernel"):  # vectors and the static conv kernels
            w.add_tensor(gguf_name, tensor.float().numpy())
        else:
            _add_matrix(w, gguf_name, tensor.float().numpy(), qtype)
    if target is not None and "d2t" in state_dict:
        target.add_head_rows(w, state_dict["d2t"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _check_dflash2_for_llama(config: dict, arch: str) -> None:
    """llama.cpp's limits on a DFlash2 file (``src/models/dflash.cpp``): the upstream arch only,
    and a hidden size that holds the packed selector lattice (top-k + top-k² floats per row).
    Raises ValueError naming the limit."""
    if arch != "dflash":
        raise ValueError("a DFlash2 drafter has no dflash-draft layout: write it with --arch dflash")
    k, h = config["dflash_config"]["selector_top_k"], config["hidden_size"]
    if h < k * (k + 1):
        raise ValueError(f"selector_top_k {k} is too large for llama.cpp at hidden size {h} "
                         f"(it packs top_k*(top_k+1) = {k * (k + 1)} scores per position into one hidden row)")


def _add_matrix(w: gguf.GGUFWriter, name: str, array: np.ndarray, qtype) -> None:
    # numpy [out, in] order; the writer records GGUF ne = [in, out] itself.
    if qtype == gguf.GGMLQuantizationType.Q8_0 and array.shape[-1] % 32 != 0:
        qtype = gguf.GGMLQuantizationType.F16  # Q8_0 blocks are 32 values along a row
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        w.add_tensor(name, gguf.quants.quantize(array, qtype))
    else:  # BF16 / Q8_0: raw bytes, so the GGML type must be given explicitly
        w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


class _TargetParts:
    """What a llama.cpp drafter file takes from the target's GGUF (module note 6).

    Args:
        path: the target's GGUF file.
        vocab_size: the drafter's ``vocab_size``, which the target's vocabulary must match.
    Raises:
        FileNotFoundError / ValueError: see :func:`save_gguf`.
    """

    def __init__(self, path: str | Path, vocab_size: int):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no target GGUF at {path}")
        self.path, self.reader = path, gguf.GGUFReader(path)
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{path}: the target GGUF has no tokenizer (tokenizer.ggml.tokens)")
        if len(tokens.data) != vocab_size:
            raise ValueError(f"{path}: the target's vocabulary has {len(tokens.data)} tokens, "
                             f"the drafter's vocab_size is {vocab_size}")

    def add_tokenizer(self, w: gguf.GGUFWriter) -> None:
        """Copy every ``tokenizer.*`` key except ``tokenizer.ggml.mask_token_id`` (the drafter's own)."""
        for name, field in self.reader.fields.items():
            if not name.startswith("tokenizer.") or name == "tokenizer.ggml.mask_token_id":
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub)

    def add_head_rows(self, w: gguf.GGUFWriter, d2t: torch.Tensor) -> None:
        """``output.weight`` = the target's LM head rows ``d2t`` (``output.weight``, or the tied
        ``token_embd.weight``), raw bytes in the target's own GGML type: each row holds whole
        quantisation blocks, so rows copy without requantising."""
        tensors = {t.name: t for t in self.reader.tensors}
        head = tensors.get("output.weight") or tensors.get("token_embd.weight")
        if head is None:
            raise ValueError(f"{self.path}: the target GGUF has neither output.weight nor token_embd.weight")
        rows = np.asarray(head.data)[d2t.to(torch.long).numpy()]  # [V_draft, bytes or values per row]
        if head.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor("output.weight", np.ascontiguousarray(rows))
        else:
            w.add_tensor("output.weight", np.ascontiguousarray(rows), raw_dtype=head.tensor_type)
