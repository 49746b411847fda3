"""The adaptive draft-length controller (``flashdraft.adaptive``) on synthetic traces, and in the loop.

Synthetic traces: a conditional acceptance profile ``alphas[k]`` (P(position k+1 accepted |
positions 1..k accepted)) and a cost model ``cost(d)`` [s] are injected; no wall clock is
read, so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.adaptive import ProfitController, make_controller
from flashdraft.drafters.ar import ARDrafter
from flashdraft.drafters.ar_model import ar_from_target
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from tiny import tiny_model, tiny_target

torch.set_num_threads(1)
GREEDY = SamplingParams()
PROMPT = [5, 9, 17, 3, 22, 41]


def cpu_like_cost(d: int) -> float:
    """Seconds per step: concave verify (DESIGN.md §5: 1 token 60 ms, 4: 86, 16: 115) + 15 ms per draft."""
    n = d + 1
    pts = [(1, 0.060), (4, 0.086), (16, 0.115), (32, 0.152)]
    for (a, ca), (b, cb) in zip(pts, pts[1:]):
        if n <= b:
            return ca + (cb - ca) * (n - a) / (b - a) + (0.015 if d else 0.0)
    raise ValueError(d)


def true_expected_tokens(alphas: list[float], d: int) -> float:
    """Brute force over every outcome: Σ_n P(exactly n accepted) · (n + 1)."""
    total = 0.0
    for n in range(d + 1):
        p_prefix = 1.0
        for a in alphas[:n]:
            p_prefix *= a
        p_stop = (1.0 - alphas[n]) if n < d else 1.0
        total += p_prefix * p_stop * (n + 1)
    return total


def true_best(alphas, cost, n_max) -> tuple[int, list[float]]:
    speeds = [true_expected_tokens(alphas, d) / cost(d) for d in range(n_max + 1)]
    return max(range(n_max + 1), key=lambda d: speeds[d]), speeds


def simulate(c: ProfitController, alphas, cost, steps: int, rng: random.Random, noise: float = 0.03) -> list[int]:
    """Run ``steps`` choose/update rounds; returns the depths chosen (probes included)."""
    chosen = []
    for _ in range(steps):
        d = c.choose()
        n = 0
        while n < d and rng.random() < alphas[n]:
            n += 1
        c.update(d, n, cost(d) * (1.0 + noise * (2 * rng.random() - 1)))
        chosen.append(d)
    return chosen


def test_expected_tokens_formula_matches_brute_force():
    """E(d) = 1 + Σ_{k≤d} α_1…α_k equals the expectation over all accept/reject outcomes."""
    c = ProfitController(6, prior_weight=1e-9)
    alphas = [0.9, 0.8, 0.5, 0.7, 0.2, 0.6]
    # feed exact rates: 1000 tests of each position, pass fraction = alpha (no decay to speak of)
    c.acceptance_decay = 1e-12
    for k, a in enumerate(alphas):
        c.tested[k], c.passed[k] = 1000.0, 1000.0 * a
    for d in range(7):
        assert c.expected_tokens(d) == pytest.approx(true_expected_tokens(alphas, d), rel=1e-6)


def test_cost_is_measured_per_depth_and_interpolated():
    c = ProfitController(8)
    for d, s in [(0, 1.0), (0, 1.0), (0, 1.0), (8, 3.0), (8, 3.0), (8, 3.0), (2, 9.0), (2, 1.5)]:
        c.update(d, 0, s)
    assert c.cost(0) == pytest.approx(1.0)
    assert c.cost(2) == pytest.approx(1.5)  # the first step at a depth (9 s, one-time work) is not used
    assert c.cost(5) == pytest.approx(1.5 + 1.5 * 3 / 6)  # between 2 and 8
    assert ProfitController(4).cost(2) is None


def affine_cost(d: int) -> float:
    """Seconds per step: 40 ms + 10 ms per draft token (a steep verify: the optimum is sharp)."""
    return 0.040 + 0.010 * d


@pytest.mark.parametrize("alphas, cost, best_expected", [
    ([0.95] * 5 + [0.0] * 11, affine_cost, 5),  # a sharp optimum: drafts past 5 are never accepted
    ([max(0.0, 0.9 - 0.02 * k) for k in range(16)], cpu_like_cost, None),  # code-like, falls with position
    ([max(0.0, 0.55 - 0.03 * k) for k in range(16)], cpu_like_cost, None),  # prose-like: depth 2 pays a little
])
def test_converges_to_the_best_depth(alphas, cost, best_expected):
    best, speeds = true_best(alphas, cost, 16)
    if best_expected is not None:
        assert best == best_expected
    assert best > 0 and speeds[best] > 1.1 * speeds[0]
    for seed in range(3):
        c = ProfitController(16)
        chosen = simulate(c, alphas, cost, 1500, random.Random(seed))
        if best_expected is not None:
            assert c.depth == best, seed
        # hysteresis may keep a neighbour of the optimum, never one more than the margin slower
        assert speeds[c.depth] >= speeds[best] / (1 + c.margin) - 1e-9, (seed, c.depth, best)
        realised = sum(true_expected_tokens(alphas, d) for d in chosen[300:]) / sum(cost(d) for d in chosen[300:])
        assert realised >= 0.95 * speeds[best], seed  # probes and noise included


def test_turns_drafting_off_when_it_never_pays():
    """~0 acceptance and a verify cost growing with depth: plain decoding (d = 0) wins."""
    alphas = [0.02] * 16
    best, _ = true_best(alphas, cpu_like_cost, 16)
    assert best == 0
    c = ProfitController(16)
    chosen = simulate(c, alphas, cpu_like_cost, 600, random.Random(1))
    assert c.depth == 0
    assert sum(d > 0 for d in chosen[100:]) <= 10  # only sparse probes after it turned off


def test_reprobes_while_off_and_recovers_when_acceptance_improves():
    c = ProfitController(16)
    rng = random.Random(2)
    bad, good = [0.0] * 16, [max(0.0, 0.9 - 0.02 * k) for k in range(16)]
    chosen = simulate(c, bad, cpu_like_cost, 1000, rng)
    assert c.depth == 0
    probes = [i for i, d in enumerate(chosen) if d > 0 and i >= 20]
    assert len(probes) >= 3  # it keeps looking...
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] > gaps[0]  # ...less often while drafting keeps losing (back-off)
    assert max(gaps) <= c.probe_every * c.max_backoff + 1
    # the prompt becomes easy: a probe notices and drafting comes back near the best depth
    best, speeds = true_best(good, cpu_like_cost, 16)
    standing = []
    for _ in range(700):
        simulate(c, good, cpu_like_cost, 1, rng)
        standing.append(c.depth)
    on_at = next(i for i, d in enumerate(standing) if d > 0)
    assert on_at <= 2 * c.probe_every * c.max_backoff + 2  # one unlucky probe (first draft rejected) allowed
    assert all(d > 0 for d in standing[on_at + 20:])  # and stays on
    assert c.depth > 0 and speeds[c.depth] >= 0.9 * speeds[best]


def test_a_new_request_probes_at_once_while_off():
    c = ProfitController(8)
    simulate(c, [0.0] * 8, affine_cost, 300, random.Random(4))
    assert c.depth == 0 and c.choose() == 0
    c.start_request()
    assert c.choose() == c.off_probe_depth
    c.update(c.off_probe_depth, 4, affine_cost(4))  # this text drafts well...
    c.start_request()  # (a request that starts while drafting is on changes nothing)
    assert c.choose() > 0  # ...and drafting is back on


def test_hysteresis_no_flapping_between_nearly_equal_depths():
    """Depths 2 and 3 within ~0.5% of each other: the standing depth must not alternate."""
    alphas = [0.8, 0.8, 0.62] + [0.0] * 5
    cost = affine_cost
    _, speeds = true_best(alphas, cost, 8)
    assert abs(speeds[2] / speeds[3] - 1) < 0.01 and max(speeds[2], speeds[3]) == max(speeds)

    def switches(margin: float) -> int:
        c = ProfitController(8, margin=margin)
        rng, depths = random.Random(3), []
        for _ in range(3000):
            simulate(c, alphas, cost, 1, rng)
            depths.append(c.depth)
        return sum(a != b for a, b in zip(depths[100:], depths[101:]))

    # estimates are noisy (±3% on v), so the standing depth may move now and then, but it
    # dwells: on average >= 100 steps per depth over 2,900 steps, and it is the margin
    # that does it (without one the depth alternates every few dozen steps)
    with_margin, without = switches(0.03), switches(0.0)
    assert with_margin <= 29
    assert 3 * with_margin <= without


def test_update_validates_and_reset_forgets():
    c = ProfitController(4)
    with pytest.raises(ValueError):
        c.update(5, 0, 0.1)
    with pytest.raises(ValueError):
        c.update(2, 3, 0.1)
    with pytest.raises(ValueError):
        c.update(2, 1, float("nan"))
    simulate(c, [0.0] * 4, lambda d: 0.01 + 0.01 * d, 200, random.Random(0))
    assert c.depth == 0 and c.steps == 200
    c.reset()
    assert c.steps == 0 and c.depth == 4 and c.cost(0) is None and c.choose() == 4
    with pytest.raises(ValueError, match="controller"):
        make_controller("bogus", 4)
    assert make_controller("off", 4) is None and make_controller("profit", 4).n_max == 4
    assert set(c.snapshot()) >= {"depth", "acceptance", "expected_tokens", "cost_ms", "tokens_per_second"}


# ---- in the loop, on a tiny model -------------------------------------------------------

class ScriptedController:
    """Cycles through fixed depths (0 included): the loop must stay lossless for any sequence."""

    def __init__(self, depths):
        self.depths, self.i, self.depth, self.seen = depths, 0, depths[0], []

    def choose(self) -> int:
        self.depth = self.depths[self.i % len(self.depths)]
        self.i += 1
        return self.depth

    def update(self, depth, n_accepted, seconds):
        assert 0 <= n_accepted <= depth and seconds >= 0
        self.seen.append((depth, n_accepted))

    def cut(self, confidence):
        # a scripted cut too (0, 1 or 2 tokens off the end): any cut must stay lossless as well
        return max(0, len(confidence) - self.i % 3)

    def reset(self):
        self.i = 0

    def start_request(self):
        pass


def test_any_depth_sequence_is_lossless_for_every_drafter():
    from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model

    target = tiny_target("qwen3")
    base = generate_text(SpeculativeGenerator(target), PROMPT, 30, GREEDY, ignore_eos=True)[1]
    drafters = {
        "ngram": NgramDrafter(),
        "dflash": DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=8),
                                target.embed_tokens, target.lm_head),  # d = 0 steps still commit features
        "draft": DraftModelDrafter(tiny_model("qwen3", seed=7), target.vocab_size),
        # d = 0 steps still commit the target's states to an EAGLE-style AR drafter
        "ar": ARDrafter(ar_from_target(target.model, 2, use_features=True), target.embed_tokens.weight,
                        target.vocab_size),
    }
    for name, drafter in drafters.items():
        ctl = ScriptedController([0, 3, 1, 0, 0, 6, 2])
        gen = SpeculativeGenerator(target, drafter, n_draft=6, controller=ctl)
        _, ids, _, t = generate_text(gen, PROMPT, 30, GREEDY, ignore_eos=True)
        assert ids == base, name
        assert any(d == 0 for d, _ in ctl.seen) and any(d > 0 for d, _ in ctl.seen), name


def test_profit_controller_turns_off_an_ar_drafter_whose_sequential_steps_cost_too_much():
    """An AR drafter pays one forward per draft token; the controller measures each depth's
    step time (draft included), so a drafter whose tokens cost more than they save is switched
    off, and the output stays the target's."""
    import time

    target = tiny_target("llama", seed=3)
    base = generate_text(SpeculativeGenerator(target), PROMPT, 80, GREEDY, ignore_eos=True)[1]

    class SlowAR(ARDrafter):
        def _run(self, ids, prev):  # a drafter forward 20 ms long: far more than a target step here
            time.sleep(0.02)
            return super()._run(ids, prev)

    ctl = ProfitController(4)
    gen = SpeculativeGenerator(target, SlowAR(ar_from_target(target.model, 1), target.embed_tokens.weight,
                                              target.vocab_size), n_draft=4, controller=ctl)
    _, ids, _, t = generate_text(gen, PROMPT, 80, GREEDY, ignore_eos=True)
    assert ids == base
    assert t.draft_depth_last == 0 and ctl.depth == 0
    assert t.draft_depth_sum < 0.5 * 4 * (t.n_steps - 1)  # most steps did not draft


def test_profit_controller_in_the_loop_is_lossless_and_reports_depth():
    target = tiny_target("llama", seed=3)
    base = generate_text(SpeculativeGenerator(target), PROMPT, 40, GREEDY, ignore_eos=True)[1]
    ctl = ProfitController(4)
    # the target drafting for itself: every draft is accepted, whatever the depth
    gen = SpeculativeGenerator(target, DraftModelDrafter(target.model, target.vocab_size), n_draft=4, controller=ctl)
    for _ in range(2):  # the second request starts from what the first learned
        _, ids, finish, t = generate_text(gen, PROMPT, 40, GREEDY, ignore_eos=True)
        assert ids == base and finish == "length"
    assert ctl.steps > 2 * ProfitController.WARMUP_STEPS  # estimates persist across requests
    d = t.to_dict(drafting=True)
    assert 0 <= d["draft_depth"] <= 4 and d["draft_depth_last"] == min(4, ctl.depth)
    assert t.draft_depth == pytest.approx(t.draft_depth_sum / (t.n_steps - 1))
    # seeded sampling stays a valid sample path through the same loop (no crash, right length)
    hot = SamplingParams(temperature=1.0, seed=5)
    assert len(generate_text(gen, PROMPT, 20, hot, ignore_eos=True)[1]) == 20


def test_controller_off_is_the_fixed_depth_and_engine_wiring():
    from flashdraft.engine import EngineConfig, load_engine

    target = tiny_target("llama", seed=3)
    off = load_engine(EngineConfig(spec_type="ngram", n_draft=5, controller="off"), target=target, warmup=False)
    assert off.controller is None
    t = generate_text(off, PROMPT, 20, GREEDY, ignore_eos=True)[3]
    assert t.draft_depth == 5 and t.draft_depth_last == 5
    on = load_engine(EngineConfig(spec_type="ngram", n_draft=5), target=target)  # profit is the default
    assert isinstance(on.controller, ProfitController) and on.controller.n_max == 5
    assert on.controller.steps == 0  # warm-up steps (first forwards, slow) were forgotten
    assert load_engine(EngineConfig(spec_type="none"), target=target, warmup=False).controller is None
    with pytest.raises(ValueError, match="controller"):
        load_engine(EngineConfig(spec_type="ngram", controller="fast"), target=target, warmup=False)


def test_flags_and_metrics_gauge():
    import argparse

    from flashdraft.engine import EngineConfig
    from flashdraft.flags import add_model_arguments
    from flashdraft.generate import Timings
    from flashdraft.server.cli import build_parser, engine_config_from_args
    from flashdraft.server.metrics import ServerMetrics

    assert engine_config_from_args(build_parser().parse_args([])).controller == "profit"
    assert engine_config_from_args(build_parser().parse_args(["--spec-dm-controller", "off"])).controller == "off"
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    assert EngineConfig.from_args(p.parse_args(["--spec-dm-controller", "off"])).controller == "off"
    m = ServerMetrics()
    m.observe_generation(Timings(predicted_n=9, n_steps=4, draft_depth_sum=7, draft_depth_last=3))
    text = m.render().decode()
    assert "llamacpp:spec_draft_depth 3.0" in text
    assert "llamacpp:spec_draft_depth_mean 2.3333" in text


def test_hybrid_keeps_one_controller_per_source():
    """A DFlash drafter that is always wrong must not turn off prompt lookup's drafts: with
    one controller per source the n-gram drafts keep coming and keep being accepted."""
    from flashdraft.adaptive import SourcedController, make_controller
    from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
    from flashdraft.drafters.hybrid import HybridDrafter

    target = tiny_target("llama", seed=3)
    prompt = [5, 9, 3, 7] * 12  # prompt lookup has matches everywhere
    base = generate_text(SpeculativeGenerator(target), prompt, 60, GREEDY, ignore_eos=True)[1]
    ctl = make_controller("profit", 6, HybridDrafter.SOURCES)
    assert isinstance(ctl, SourcedController)
    dflash = DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=8), target.embed_tokens,
                           target.lm_head)
    hybrid = HybridDrafter(dflash)
    gen = SpeculativeGenerator(target, hybrid, n_draft=6, controller=ctl)
    _, ids, _, t = generate_text(gen, prompt, 60, GREEDY, ignore_eos=True)
    assert ids == base
    assert ctl.controllers["ngram"].steps > 0
    assert sum(c.steps for c in ctl.controllers.values()) == t.n_steps - 1
    assert t.draft_n_accepted > 0
    assert type(make_controller("profit", 6)) is ProfitController and make_controller("off", 6, ("a", "b")) is None


def test_sourced_controller_picks_the_source_that_gains_most():
    from flashdraft.adaptive import SourcedController

    c = SourcedController(4, ("ngram", "dflash"))
    assert c.pick(("ngram", "dflash")) == "ngram"  # no step times yet: try it
    for source, accepted in (("ngram", 4), ("dflash", 0)):
        ctl = c.for_source(source)
        for i in range(40):
            d = ctl.choose()
            ctl.update(d, min(d, accepted), 0.010 + 0.002 * d)
    assert c.pick(("ngram", "dflash")) == "ngram" and c.pick(("dflash", "ngram")) == "ngram"
    assert c.controllers["dflash"].depth == 0 and c.controllers["ngram"].depth > 0


def test_hybrid_copies_past_the_dflash_block():
    """Prompt lookup in the hybrid drafts up to ``ngram_depth`` tokens while DFlash drafts
    stay within its block, each source's controller is capped at its own longest draft, and
    greedy output is still the target's."""
    from flashdraft.adaptive import make_controller
    from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
    from flashdraft.drafters.hybrid import HybridDrafter

    target = tiny_target("llama", seed=3)
    dflash = DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=4), target.embed_tokens,
                           target.lm_head)
    hybrid = HybridDrafter(dflash, ngram_depth=10)
    assert hybrid.max_draft == 10 and hybrid.source_max_draft == {"ngram": 10, "dflash": 3, "dflash-matched": 3}
    with pytest.raises(ValueError, match="ngram_depth"):
        HybridDrafter(dflash, ngram_depth=0)
    tokens = torch.tensor(list(range(20, 32)) + [20, 21])  # "20 21" seen before: 22..31 20 21 follow
    assert hybrid.next_source(tokens) == "ngram"
    assert hybrid.propose(tokens, 10, GREEDY, torch.Generator()).tokens.tolist() == list(range(22, 32))
    hybrid.reset()
    hybrid.next_source(torch.tensor([40, 41, 42]))  # nothing to copy: DFlash, at most its block
    assert len(hybrid.propose(torch.tensor([40, 41, 42]), 10, GREEDY, torch.Generator()).tokens) <= 3
    ctl = make_controller("profit", 10, HybridDrafter.SOURCES, hybrid.source_max_draft)
    assert {s: c.n_max for s, c in ctl.controllers.items()} == {"ngram": 10, "dflash": 3, "dflash-matched": 3}

    prompt = [5, 9, 3, 7] * 12
    for seed in (3, 5):  # seed 5's answer repeats a 4-token cycle: copies longer than the block pay
        target = tiny_target("llama", seed=seed)
        dflash = DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=4), target.embed_tokens,
                               target.lm_head)
        base = generate_text(SpeculativeGenerator(target), prompt, 60, GREEDY, ignore_eos=True)[1]
        for controlled in (False, True):
            hybrid = HybridDrafter(dflash, ngram_depth=10)
            ctl = make_controller("profit", 10, HybridDrafter.SOURCES, hybrid.source_max_draft) if controlled else None
            gen = SpeculativeGenerator(target, hybrid, n_draft=10, controller=ctl)
            _, ids, _, t = generate_text(gen, prompt, 60, GREEDY, ignore_eos=True)
            assert ids == base
            if ctl is not None:
                assert max(ctl.controllers["dflash"].depth, ctl.controllers["dflash-matched"].depth) <= 3
            elif seed == 5:
                assert len(t.drafted_per_position) == 10 and t.accepted_per_position[3] > 0
