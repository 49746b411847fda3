"""Change a warm-started drafter's shape without losing what it has learned.

A recipe lever such as "2 layers instead of 1" or "add target layer 20 to the context
features" cannot be measured fairly from a fresh drafter on this CPU: a fresh drafter needs
hours to reach the shipped one's τ. These helpers start the changed drafter *exactly* where
the shipped one is (the same function on every input) and let training move from there:

- more layers: the new layers are copies of target layers with their residual outputs
  (``o_proj``, ``down_proj``) zeroed, so each new layer starts as the identity (the
  zero-init residual trick of Goyal et al., 2017, "Accurate, Large Minibatch SGD", §5.1);
- more feature layers: ``fc`` gains zero columns for the new layers, so the fused context
  is unchanged until training gives them weight;
- block size and draft vocabulary change no weights (positions are RoPE, the head is the
  target's own, sliced by ``d2t``).
"""

from __future__ import annotations

import copy

import torch

from flashdraft.drafters.dflash import DFlashDraftModel, copy_target_layer

_UNCHANGED = object()


def adapt_drafter(model: DFlashDraftModel, target_model, *, block_size: int | None = None,
                  num_layers: int | None = None, feature_layer_ids: list[int] | None = None,
                  init_layers: list[int] | None = None, d2t=_UNCHANGED) -> DFlashDraftModel:
    """A drafter of the requested shape that computes what ``model`` computes.

    Args:
        model: the warm-start drafter (unchanged; a new module is returned when the shape
            changes).
        target_model: the target's transformers model (new layers are copied from it).
        block_size: new block size, or None to keep ``model``'s.
        num_layers: new number of decoder layers (≥ the current), or None.
        feature_layer_ids: new context-feature target layers, or None. Layers kept from the
            old list keep their ``fc`` columns; new ones start at zero.
        init_layers: target layers the *new* decoder layers are copied from (default: the
            target's last ones).
        d2t: new draft vocabulary ``[V_d]`` (target ids), ``None`` for the full vocabulary,
            or left out to keep ``model``'s.
    Returns:
        the adapted :class:`DFlashDraftModel` (float32).
    Raises:
        ValueError: ``num_layers`` is smaller than the current number of layers.
    """
    config = copy.deepcopy(model.config)
    old_layers = len(model.layers)
    old_ids = list(model.target_layer_ids)
    if num_layers is not None and num_layers < old_layers:
        raise ValueError(f"--layers {num_layers}: cannot remove layers from a {old_layers}-layer warm start")
    if block_size is not None:
        config["block_size"] = int(block_size)
        config.get("dflash_config", {}).pop("block_size", None)
    if num_layers is not None:
        config["num_hidden_layers"] = int(num_layers)
    new_ids = list(feature_layer_ids) if feature_layer_ids else old_ids
    config.setdefault("dflash_config", {})["target_layer_ids"] = new_ids

    new = DFlashDraftModel(config)
    new.set_draft_vocab(model.d2t if d2t is _UNCHANGED else d2t)
    state = {k: v for k, v in model.state_dict().items() if k not in ("fc.weight", "d2t")}
    missing, unexpected = new.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    h = config["hidden_size"]
    layers = target_model.get_decoder().layers
    with torch.no_grad():
        # fc: [H, k*H]; column block j reads target layer ids[j]
        new.fc.weight.zero_()
        for j, lid in enumerate(new_ids):
            if lid in old_ids:
                i = old_ids.index(lid)
                new.fc.weight[:, j * h:(j + 1) * h] = model.fc.weight[:, i * h:(i + 1) * h]
        added = list(range(old_layers, len(new.layers)))
        sources = init_layers or list(range(len(layers) - len(added), len(layers)))
        for layer_index, src in zip(added, sources):
            layer = new.layers[layer_index]
            copy_target_layer(layer, layers[src])
            # identity at the start: the residual branches add nothing until trained
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    new.ngram_seeded = model.ngram_seeded
    return new
