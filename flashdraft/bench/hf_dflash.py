"""Our DFlash drafter inside transformers' own DFlash loop (``speculation_type="dflash"``).

transformers 5.23 runs DFlash through ``DFlashTokenCandidateGenerator``, which calls the
assistant as ``assistant(noise_embeds=, context_hidden_states=, position_ids=,
attention_mask=, past_key_values=DFlashCache)`` and reads ``config.block_size``,
``config.mask_token_id`` and ``config.target_layer_ids``. The only drafter network it ships
with that signature is ``MuseGlimmerAssistantModel``: the same architecture as a
z-lab/SpecForge DFlash drafter (``encoder.fc`` + ``encoder.output_norm_enc`` = our ``fc`` +
``hidden_norm``; per-layer q/k-norm, RoPE, SwiGLU; a final norm), so a SpecForge
checkpoint loads into it by renaming two tensors. The benchmark then measures
transformers' implementation of the whole loop, drafter forward included, with our weights.

Limits (raised as :class:`HFDFlashUnsupported`): drafters with attention biases (that class
has none) and transformers versions without the class. Not raised but reported
(:func:`draft_vocab_note`): transformers projects draft hidden states with the target's whole
LM head, so a drafter trained with a reduced draft vocabulary (``d2t``) drafts over the full
vocabulary there; its τ in transformers may then be lower than in our engine.
"""

from __future__ import annotations

from torch import nn

from flashdraft.drafters.dflash import DFlashDraftModel

#: our (SpecForge) weight name -> transformers' name; every other name is the same
_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


class HFDFlashUnsupported(RuntimeError):
    """This drafter or this transformers version cannot run in transformers' DFlash loop."""


def hf_dflash_assistant(drafter: DFlashDraftModel) -> nn.Module:
    """Build transformers' DFlash drafter network holding ``drafter``'s weights.

    Args:
        drafter: our loaded drafter (any dtype; the copy keeps it).
    Returns:
        A ``MuseGlimmerAssistantModel`` in eval mode, ready for
        ``generate(assistant_model=..., speculation_type="dflash")``.
    Raises:
        HFDFlashUnsupported: see the module docstring.
    """
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
        from transformers.generation import DFlashTokenCandidateGenerator  # noqa: F401 (presence check)
    except ImportError as e:
        import transformers
        raise HFDFlashUnsupported(f"transformers {transformers.__version__} has no DFlash assistant "
                                  f"model/candidate generator ({e})") from None
    cfg = drafter.config
    if cfg.get("attention_bias"):
        raise HFDFlashUnsupported("this drafter has attention biases; transformers' DFlash drafter has none")
    n_layers = int(cfg["num_hidden_layers"])
    hf_config = MuseGlimmerAssistantConfig(
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=n_layers, num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg["num_key_value_heads"]), head_dim=int(drafter.head_dim),
        rms_norm_eps=float(cfg["rms_norm_eps"]), hidden_act=cfg.get("hidden_act", "silu"),
        rope_parameters={"rope_type": "default", "rope_theta": drafter.rope_theta},
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        # DFlash attends to the whole context; the class defaults to a 2048-token sliding window
        layer_types=["full_attention"] * n_layers,
        block_size=drafter.block_size, mask_token_id=drafter.mask_token_id,
        target_layer_ids=list(drafter.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = MuseGlimmerAssistantModel(hf_config)
    # d2t (reduced draft vocabulary) has no place in transformers' loop: see draft_vocab_note
    state = {_RENAMES.get(k, k): v for k, v in drafter.state_dict().items() if k != "d2t"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HFDFlashUnsupported(f"weights do not map onto transformers' DFlash drafter: "
                                  f"missing {missing}, unexpected {unexpected}")
    dtype = drafter.fc.weight.dtype
    return model.to(dtype).eval().requires_grad_(False)


def draft_vocab_note(drafter: DFlashDraftModel) -> str | None:
    """What transformers ignores of ``drafter`` (None when nothing): its reduced vocabulary."""
    d2t = getattr(drafter, "d2t", None)
    if d2t is None:
        return None
    return (f"the drafter's reduced draft vocabulary ({d2t.numel()} tokens, d2t) is ignored: "
            "transformers drafts over the full vocabulary")
