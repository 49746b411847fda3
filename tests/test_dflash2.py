"""DFlash2 path selection: the selector and convolutions, their objective, the walk, the
checkpoint formats (ours, z-lab's package, llama.cpp) and losslessness."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flashdraft.drafters.dflash import DFlashDraftModel, DFlashDrafter, random_dflash_model
from flashdraft.drafters.dflash_format import dflash_weight_shapes, load_dflash_checkpoint, save_gguf, save_specforge
from flashdraft.drafters.selector import CandidateSelector, DynamicCausalConv
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.train.loop import to_dflash2
from flashdraft.train.objective import dflash_loss, sample_anchors
from flashdraft.train.walk import DFlashProposals, target_features, walk_dataset
from test_walk import MAX_TOKENS, SAME, _online_ids, baseline_answers, briefly_trained_drafter
from tiny import VOCAB, tiny_target

GREEDY = SamplingParams()
LAYERS = [2]  # a 1-layer drafter's feature layer on the 4-layer tiny target (build_target_layer_ids)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5, layers=4)


def perturbed(model: DFlashDraftModel, seed: int = 1, scale: float = 0.5, convs: bool = True) -> DFlashDraftModel:
    """Random selector (and conv) weights (an untrained selector picks the argmax path)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "candidate_selector" in name or (convs and "kernel_projection" in name):
                p.copy_(scale * torch.randn(p.shape, generator=gen))
            elif convs and "base_kernel" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def test_identity_convolutions_change_nothing():
    conv = DynamicCausalConv(32, kernel=3, group=8)
    x = torch.randn(2, 5, 32)
    assert torch.equal(conv.apply(x, conv.coefficients(x), 0), x)
    with pytest.raises(ValueError, match="divide"):
        DynamicCausalConv(30, 2, 16)


def test_convolution_is_causal_along_the_block():
    conv = DynamicCausalConv(16, kernel=2, group=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 6, 16)
    y = conv.apply(x, conv.coefficients(x), 1)
    x2 = x.clone()
    x2[0, 4] += 1.0  # a later position changes nothing before it
    y2 = conv.apply(x2, conv.coefficients(x2), 1)
    assert torch.equal(y[0, :4], y2[0, :4]) and not torch.equal(y[0, 4:], y2[0, 4:])


def test_walk_follows_the_chosen_predecessor():
    sel = CandidateSelector(hidden=8, vocab=10, rank=4, top_k=3)
    with torch.no_grad():
        sel.predecessor_codebook.weight.normal_()
        sel.successor_codebook.weight.normal_()
    hidden, logits = torch.randn(2, 4, 8), torch.randn(2, 4, 10)
    anchors = torch.tensor([1, 7])
    idx, q, cand, scores = sel.walk(hidden, logits, anchors, None)
    assert q is None and idx.shape == (2, 4) and cand.shape == scores.shape == (2, 4, 3)
    for b in range(2):  # recompute each step by hand from the token chosen before it
        prev = anchors[b]
        for i in range(4):
            s = sel.scores(prev[None], hidden[b, i][None], logits[b, i].topk(3).values[None], cand[b, i][None])[0]
            assert int(cand[b, i, s.argmax()]) == int(idx[b, i])
            prev = idx[b, i]


def test_top_1_is_the_plain_drafter_bit_for_bit(target):
    """With k = 1 the selector has one candidate: the argmax, whatever its weights (the
    convolutions of a converted drafter are the identity)."""
    torch.manual_seed(0)
    plain = random_dflash_model(target.model, num_layers=1, block_size=6, mask_token_id=63)
    k1 = perturbed(to_dflash2(plain, top_k=1), convs=False)
    prompt = [5, 9, 3, 7] * 6
    outs = []
    for model in (plain, k1):
        d = DFlashDrafter(model, target.embed_tokens, target.lm_head)
        target.set_feature_layers(d.feature_layer_ids)
        ids = torch.tensor(prompt)
        _, feats = target.forward(ids[:-1], target.new_cache(ids.shape[0] + 1), 0)
        d.commit(ids.shape[0] - 1, feats)
        outs.append(d.propose(ids, 5, GREEDY, None).tokens.tolist())
        gen = SpeculativeGenerator(target, d, n_draft=5)
        _, out, _, t = generate_text(gen, prompt, 40, GREEDY, ignore_eos=True)
        outs.append((out, t.draft_n, t.draft_n_accepted, t.n_steps))
    assert outs[0] == outs[2] and outs[1] == outs[3]


def test_to_dflash2_keeps_the_argmax_path_until_trained(target):
    plain = random_dflash_model(target.model, num_layers=1, block_size=6, mask_token_id=63)
    new = to_dflash2(plain, top_k=4)
    answers = baseline_answers(target)
    sid, ids, n_prompt, _ = answers[0]
    feats = target_features(target, ids, plain.target_layer_ids)
    w = target.lm_head.weight
    a = DFlashProposals(plain, target.embed_tokens.weight, w, None, feats, ids, n_prompt).table
    b = DFlashProposals(new, target.embed_tokens.weight, w, None, feats, ids, n_prompt).table
    assert torch.equal(a, b)


@pytest.mark.parametrize("top_k", [1, 4])
def test_greedy_output_is_the_targets(target, top_k):
    prompt = [5, 9, 3, 7] * 12
    base = generate_text(SpeculativeGenerator(target), prompt, 60, GREEDY, ignore_eos=True)[1]
    model = perturbed(to_dflash2(random_dflash_model(target.model, 1, 8, mask_token_id=63), top_k))
    for p_min in (0.0, 0.3):
        d = DFlashDrafter(model, target.embed_tokens, target.lm_head, p_min=p_min)
        _, ids, _, t = generate_text(SpeculativeGenerator(target, d, n_draft=7), prompt, 60, GREEDY, ignore_eos=True)
        assert ids == base and t.n_steps > 1


def test_sampled_output_has_the_targets_distribution():
    """T > 0: drafts drawn from softmax(scores / T) over the top-k, q zero elsewhere; the
    speculative-sampling residual restores the target's marginals (chi-square)."""
    from test_sampling import assert_sampled_marginals

    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    params = SamplingParams(temperature=1.0, top_k=20)
    prompt = [3, 14, 15, 3, 14]
    torch.manual_seed(0)
    model = perturbed(to_dflash2(random_dflash_model(target.model, 1, 4), top_k=4), scale=0.3)
    gen = SpeculativeGenerator(target, DFlashDrafter(model, target.embed_tokens, target.lm_head), n_draft=3)
    assert_sampled_marginals(gen, target, prompt, params)


def test_walk_equals_online_loop_for_a_dflash2_drafter(target):
    answers = [(sid, ids, n, target_features(target, ids, LAYERS)) for sid, ids, n, _ in baseline_answers(target)]
    plain = briefly_trained_drafter(target, answers, 6, steps=30)
    model = perturbed(to_dflash2(plain, top_k=4), scale=0.3).eval()
    drafter = DFlashDrafter(model, target.embed_tokens, target.lm_head)
    want = _online_ids(SpeculativeGenerator(target, drafter, n_draft=5))
    assert 0 < want["draft_n_accepted"] < want["draft_n"]
    tables = []

    def proposer(ids, n_prompt, feats):
        p = DFlashProposals(model, target.embed_tokens.weight, target.lm_head.weight, None, feats, ids, n_prompt)
        tables.append(p.table)
        return p

    got = walk_dataset(answers, proposer, 5, MAX_TOKENS, target.eos_token_ids)
    for key in SAME:
        assert got[key] == want[key], key
    plain_tables = [DFlashProposals(plain, target.embed_tokens.weight, target.lm_head.weight, None, f, i, n).table
                    for _, i, n, f in answers]
    assert any(not torch.equal(a, b) for a, b in zip(tables, plain_tables))  # the selector chose otherwise


def test_selector_loss_teaches_the_path(target):
    """A frozen drafter, the selector alone trained on the target's answers: the share of
    rows where it picks the label rises above the argmax's."""
    answers = [(sid, ids, n, target_features(target, ids, LAYERS)) for sid, ids, n, _ in baseline_answers(target)]
    plain = briefly_trained_drafter(target, answers, 6, steps=10)
    model = to_dflash2(plain, top_k=8, rank=16)
    model.requires_grad_(False)
    model.candidate_selector.requires_grad_(True)
    opt = torch.optim.Adam(model.candidate_selector.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(0)
    args = (target.embed_tokens.weight.detach(), target.lm_head.weight.detach(), None, 4.0)

    def accuracy():
        c = n = 0
        for _, ids, n_prompt, feats in answers:
            anchors = torch.arange(n_prompt, ids.shape[0] - 1)
            _, ci, ni = dflash_loss(model, feats, ids, anchors, *args)
            c, n = c + ci.sum(), n + ni.sum()
        return float(c / n)

    before = accuracy()
    for step in range(60):
        _, ids, n_prompt, feats = answers[step % len(answers)]
        loss, _, _ = dflash_loss(model, feats, ids, sample_anchors(n_prompt, ids.shape[0], 16, gen), *args)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert accuracy() > before + 0.05
    assert all(not p.requires_grad or "candidate_selector" in n for n, p in model.named_parameters())


def _dflash2_checkpoint(target, top_k=4, d2t=True):
    model = perturbed(to_dflash2(random_dflash_model(target.model, 1, 4, mask_token_id=VOCAB - 1), top_k))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if d2t:
        state["d2t"] = torch.arange(0, VOCAB, 2, dtype=torch.int64)
    return model.config, state


@pytest.mark.parametrize("fmt", ["specforge", "gguf"])
def test_formats_round_trip(tmp_path, target, fmt):
    config, state = _dflash2_checkpoint(target)
    if fmt == "gguf":
        with pytest.raises(ValueError, match="--arch dflash"):
            save_gguf(tmp_path / "x.gguf", config, state, arch="dflash-draft")
        save_gguf(tmp_path / "x.gguf", config, state, arch="dflash", dtype=torch.float32)
        path = tmp_path / "x.gguf"
    else:
        save_specforge(tmp_path / "sf", config, state, dtype=torch.float32)
        path = tmp_path / "sf"
        from safetensors import safe_open

        names = set(safe_open(str(path / "model.safetensors"), "pt").keys())
        assert "candidate_selector.successor_codebook" in names  # z-lab's name, no ".weight"
    got_config, got = load_dflash_checkpoint(path)
    assert got_config["architectures"] == ["DFlash2DraftModel"]
    for key in ("selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size"):
        assert got_config["dflash_config"][key] == config["dflash_config"][key]
    assert set(got) == set(state)
    for k in state:
        assert torch.equal(got[k].to(state[k].dtype), state[k]), k
    assert set(dflash_weight_shapes(got_config)) == set(state) - {"d2t"}


def test_llama_cpp_limit_on_top_k_is_named(tmp_path, target):
    config, state = _dflash2_checkpoint(target, top_k=8)  # hidden 64 < 8 * 9
    with pytest.raises(ValueError, match="too large for llama.cpp"):
        save_gguf(tmp_path / "x.gguf", config, state, arch="dflash")


@pytest.mark.skipif(importlib.util.find_spec("dflash") is None,
                    reason="z-lab's dflash package is not installed (make zlab-peer)")
def test_zlab_dflash2_loads_our_export_and_picks_the_same_path(tmp_path, target):
    """z-lab's ``DFlash2DraftModel`` on our export: the same hidden states and the same path."""
    from transformers import DynamicCache

    from flashdraft.bench.zlab import export_zlab, load_zlab_drafter

    config, state = _dflash2_checkpoint(target, d2t=False)
    save_specforge(tmp_path / "ours", config, state, dtype=torch.float32)
    out, limits = export_zlab(tmp_path / "ours", tmp_path / "zlab")
    assert limits == []
    theirs = load_zlab_drafter(out)
    assert type(theirs).__name__ == "DFlash2DraftModel"
    ours = DFlashDraftModel(config)
    ours.load_state_dict(state)
    prompt = torch.tensor([5, 9, 3, 7] * 5)
    target.set_feature_layers(ours.target_layer_ids)
    _, feats = target.forward(prompt[:-1], target.new_cache(prompt.shape[0] + 1), 0)
    d = DFlashDrafter(ours.eval(), target.embed_tokens, target.lm_head)
    d.commit(prompt.shape[0] - 1, feats)
    want = d.propose(prompt, 3, GREEDY, None).tokens.tolist()

    block = torch.tensor([[int(prompt[-1])] + [VOCAB - 1] * 3])
    n_ctx = feats.shape[0]
    with torch.no_grad():
        hidden = theirs(target_hidden=feats[None].float(), noise_embedding=target.embed_tokens(block),
                        position_ids=torch.arange(n_ctx + 4)[None], past_key_values=DynamicCache(),
                        use_cache=True)[:, -3:]
        tokens, _, _ = theirs.propose(hidden, block[:, 0], target.lm_head, 0.0)
    assert tokens[0].tolist() == want


def test_trainer_trains_only_the_selector_and_exports_dflash2(tmp_path, target):
    """``flashdraft train --init-from D --selector-top-k K --train-only selector``: the drafter
    stays as it was, the selector moves, the export is a DFlash2 drafter, and a resumed run
    keeps the DFlash2 shape."""
    import json

    from flashdraft.drafters.dflash import load_dflash_model
    from flashdraft.train.export import export_drafter
    from flashdraft.train.loop import TrainConfig, Trainer

    lines = [json.dumps({"id": sid, "prompt_ids": ids[:n].tolist(), "response_ids": ids[n:].tolist()})
             for sid, ids, n, _ in baseline_answers(target)]
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    warm = random_dflash_model(target.model, num_layers=1, block_size=4, mask_token_id=63)
    export_drafter(warm, tmp_path / "warm", "specforge", dtype=torch.float32)
    cfg = dict(data_dir=str(data), out_dir=str(tmp_path / "run"), init_from=str(tmp_path / "warm"),
               selector_top_k=4, selector_rank=8, train_only="selector", blocks_per_step=8, seqs_per_step=2,
               eval_minutes=0, bf16=False, lr=1e-2)
    trainer = Trainer(TrainConfig(steps=3, **cfg), target=target)
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    trainer.train()
    moved = {k for k, v in trainer.drafter.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and all(k.startswith("candidate_selector.") for k in moved)
    exported = load_dflash_model(tmp_path / "run" / "drafter")
    assert exported.candidate_selector is not None and exported.candidate_selector.top_k == 4
    resumed = Trainer(TrainConfig(steps=4, **cfg), target=target)
    assert resumed.step == 3 and resumed.drafter.candidate_selector.rank == 8
    with pytest.raises(ValueError, match="--selector-top-k"):
        Trainer(TrainConfig(steps=1, **{**cfg, "selector_top_k": 0, "out_dir": str(tmp_path / "r2")}), target=target)


def test_selector_lr_is_its_own_group_and_resume_checks_groups(tmp_path, target):
    """``--selector-lr``: the selector trains at its own peak rate beside the body's, in the
    cosine schedule's proportion; a resume with another group split fails with a message."""
    import json

    from flashdraft.train.export import export_drafter
    from flashdraft.train.loop import TrainConfig, Trainer

    lines = [json.dumps({"id": sid, "prompt_ids": ids[:n].tolist(), "response_ids": ids[n:].tolist()})
             for sid, ids, n, _ in baseline_answers(target)]
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    export_drafter(random_dflash_model(target.model, num_layers=1, block_size=4, mask_token_id=63),
                   tmp_path / "warm", "specforge", dtype=torch.float32)
    cfg = dict(data_dir=str(data), out_dir=str(tmp_path / "run"), init_from=str(tmp_path / "warm"),
               selector_top_k=4, selector_rank=8, blocks_per_step=8, seqs_per_step=2,
               eval_minutes=0, bf16=False, lr=1e-4, selector_lr=3e-3)
    trainer = Trainer(TrainConfig(steps=4, **cfg), target=target)
    body, sel = trainer.opt.param_groups
    n_sel = sum(p.numel() for p in trainer.drafter.candidate_selector.parameters())
    assert sum(p.numel() for p in sel["params"]) == n_sel
    assert sum(p.numel() for p in body["params"]) == sum(p.numel() for p in trainer.drafter.parameters()) - n_sel
    trainer.train()
    assert sel["lr"] == pytest.approx(30 * body["lr"]) and body["lr"] > 0
    with pytest.raises(ValueError, match="parameter groups"):
        Trainer(TrainConfig(steps=5, **{**cfg, "train_only": "selector"}), target=target)


def test_convert_writes_a_dflash2_drafter_as_upstream_dflash(tmp_path, target, capsys):
    import gguf

    from flashdraft.cli import main

    config, state = _dflash2_checkpoint(target, top_k=4)
    save_specforge(tmp_path / "sf", config, state, dtype=torch.float32)
    assert main(["convert", str(tmp_path / "sf"), str(tmp_path / "d.gguf")]) == 0
    assert "gguf (dflash, f16)" in capsys.readouterr().out
    reader = gguf.GGUFReader(tmp_path / "d.gguf")
    assert reader.fields["general.architecture"].contents() == "dflash"
    assert reader.fields["dflash.selector_top_k"].contents() == 4
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_conv_base", "blk.0.ffn_conv_proj.weight", "selector_hidden.weight"} <= names
    assert main(["convert", str(tmp_path / "sf"), str(tmp_path / "x.gguf"), "--arch", "dflash-draft"]) == 1
    assert "--arch dflash" in capsys.readouterr().err
