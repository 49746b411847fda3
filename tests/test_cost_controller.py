"""The ``cost`` depth controller: the measured cost table and per-draft cuts by the drafter's
own confidence (flashdraft/costs.py, flashdraft/adaptive.py ``ProfitController.cut``)."""

from __future__ import annotations

import pytest
import torch
from tiny import byte_tokenizer, tiny_model

from flashdraft.adaptive import ProfitController, make_controller
from flashdraft.costs import CostTable, load_or_measure, measure

# a made-up CPU-like table: a one-token step 10 ms, each extra row 6 ms (the llama backend at
# one thread on Q4_1 is about this shape: 8 rows = 5 steps)
CPU_MS = [10.0 + 6.0 * (k - 1) for k in range(1, 18)]
# a GPU-like table: 16 rows cost 1.2 steps
GPU_MS = [10.0 + 0.15 * (k - 1) for k in range(1, 18)]


def _ctl(table_ms, n_max=7):
    return ProfitController(n_max, verify_costs=CostTable(table_ms, 256).verify_seconds(n_max))


def test_cost_table_rows_and_extension():
    t = CostTable([10.0, 16.0, 22.0], 256)
    assert t.block(1) == 10.0 and t.block(3) == 22.0
    assert t.block(5) == pytest.approx(34.0)  # the last slope, 6 ms a row
    assert t.verify_seconds(2) == pytest.approx([0.010, 0.016, 0.022])
    with pytest.raises(ValueError):
        t.block(0)


def test_cut_keeps_confident_drafts_and_drops_unlikely_ones():
    ctl = _ctl(CPU_MS)
    # a calibrated drafter at 0.95 per position: on this table each extra row costs 0.6 of a
    # step, so the expected gain of a row (0.95^k) pays for the first few rows, not for all 7
    d = ctl.cut([0.95] * 7)
    assert 2 <= d < 7
    # 0.3 per position: even one draft costs more (0.6 step) than it is expected to give (0.3)
    assert ctl.cut([0.3] * 7) == 0
    # confident first, then unsure: cut where it turns
    assert ctl.cut([0.99, 0.99, 0.99, 0.05, 0.99, 0.99, 0.99]) == 3
    # empty draft
    assert ctl.cut([]) == 0


def test_cut_on_a_cheap_verify_keeps_the_whole_draft():
    ctl = _ctl(GPU_MS)
    assert ctl.cut([0.6] * 7) == 7  # rows nearly free: every draft with any chance pays


def test_cut_learns_an_overconfident_drafter():
    ctl = _ctl(CPU_MS)
    assert ctl.cut([0.95] * 7) > 0
    # the drafter says 0.95, but position 1 is never accepted: the 0.9-1.0 bin learns it
    for _ in range(60):
        d = ctl.cut([0.95] * 7)
        ctl.update(d, 0, 1e-3 * (CPU_MS[d] + 3.0))  # the table's verify and a 3 ms draft
    assert ctl.calibrated(0.95) < 0.5
    assert ctl.cut([0.95] * 7) == 0
    # a probe verifies the whole draft, so a bin that a cut would never test again is refreshed
    ctl._probing = True
    assert ctl.cut([0.95] * 7) == 7


def test_standing_depth_uses_the_table_from_the_first_decision():
    # the profit controller without a table knows no cost before it measures; the cost
    # controller knows the curve at once and only learns acceptance
    ctl = _ctl(CPU_MS)
    assert ctl.cost_curve() == pytest.approx([1e-3 * CPU_MS[d] for d in range(8)])
    assert ProfitController(7).cost_curve() is None
    # a drafter that is never right: after warm-up the controller turns drafting off
    for _ in range(20):
        d = ctl.choose()
        ctl.update(d, 0, 1e-3 * CPU_MS[d])
    assert ctl.depth == 0


def test_profit_controller_never_cuts():
    ctl = ProfitController(7)
    assert ctl.cut([0.01] * 7) == 7


def test_make_controller_cost_needs_the_table():
    with pytest.raises(ValueError):
        make_controller("cost", 7)
    c = make_controller("cost", 7, ("ngram", "dflash"), {"dflash": 4},
                        verify_costs=CostTable(CPU_MS, 256).verify_seconds(7))
    assert len(c.controllers["dflash"].verify_costs) == 5 and len(c.controllers["ngram"].verify_costs) == 8
    assert make_controller("profit", 7).verify_costs is None


def test_measure_and_cache_on_a_tiny_target(tmp_path, monkeypatch):
    from flashdraft.targets.torch import Target

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    t = Target(tiny_model("llama", 0), byte_tokenizer(), name="tiny-llama")
    table = measure(t, k_max=4, context=32, reps=2)
    assert len(table.block_ms) == 4 and all(x > 0 for x in table.block_ms)
    first = load_or_measure(t, k_max=4, context=32, reps=2)
    assert (tmp_path / "flashdraft" / "costs.json").exists()
    again = load_or_measure(t, k_max=4, context=32, reps=2)
    assert again.block_ms == pytest.approx(first.block_ms, abs=1e-3)  # read back, not measured again


def test_cost_controller_is_lossless_on_a_tiny_model(monkeypatch, tmp_path):
    """Greedy output with the cost controller (cuts included) equals plain decoding."""
    from flashdraft.engine import EngineConfig, load_engine
    from flashdraft.generate import generate_text
    from flashdraft.sampling import SamplingParams
    from flashdraft.targets.torch import Target

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    t = Target(tiny_model("llama", 0), byte_tokenizer(), name="tiny-llama")
    ids = t.encode("abcabcabcabd abcabc")
    plain = load_engine(EngineConfig(spec_type="none"), target=t, warmup=False)
    want = generate_text(plain, ids, 40, SamplingParams())[1]
    for spec in ("dflash", "hybrid", "ngram"):
        cfg = EngineConfig(spec_type=spec, draft_model="random:1" if spec != "ngram" else None, controller="cost",
                           n_draft=7)
        gen = load_engine(cfg, target=t, warmup=False)
        got = generate_text(gen, ids, 40, SamplingParams())[1]
        assert got == want, spec
    torch.manual_seed(0)


def test_make_serve_runs_the_bench_default():
    """The bench's ``default`` configuration is what ``make serve`` starts."""
    from pathlib import Path

    from flashdraft.bench.contender import SERVE_DEFAULT, adaptive_base, controller_of

    line = next(x for x in (Path(__file__).parent.parent / "Makefile").read_text().splitlines()
                if x.startswith("SERVE_FLAGS"))
    flags = line.split(":=")[1].split()
    assert flags[flags.index("--spec-type") + 1] == adaptive_base(SERVE_DEFAULT) == adaptive_base("default")
    assert flags[flags.index("--spec-dm-controller") + 1] == controller_of(SERVE_DEFAULT) == controller_of("default")


def test_a_free_lookup_draft_is_asked_for_even_with_drafting_off():
    """Prompt lookup under the cost controller: with the standing depth at 0 (drafting off)
    the loop still asks for the longest draft, and the table with the draft's confidence
    cuts it (a copy that starts after a failed probe is not missed); a drafter whose drafts
    cost a forward waits for the controller."""
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.generate import GenerationRequest, Sequence, SpeculativeGenerator
    from flashdraft.targets.torch import Target

    t = Target(tiny_model("llama", 0), byte_tokenizer(), name="tiny-llama")
    for free in (True, False):
        drafter = NgramDrafter()
        drafter.free_drafts = free
        ctl = _ctl(CPU_MS)
        for _ in range(ctl.WARMUP_STEPS + 4):  # never accepted: the controller turns drafting off
            d = ctl.choose()
            ctl.update(d, 0, 1e-3 * CPU_MS[d])
        assert ctl.depth == 0
        gen = SpeculativeGenerator(t, drafter, ctx_size=128, n_draft=7, controller=ctl)
        seq = Sequence(gen, GenerationRequest(t.encode("abcdefgh abcdefgh abcdef"), 8))
        assert seq._choose_depth() == (4, 0)  # a new request while off: its first step probes
        ctl.update(4, 0, 1e-3 * CPU_MS[4])
        assert seq._choose_depth() == ((7, 0) if free else (0, 0))
    # the cut keeps a long, confident copy and drops a one-token match on this table
    ctl = _ctl(CPU_MS)
    d = NgramDrafter()
    assert ctl.cut([d.FIRST_CONFIDENCE[0]] + [d.LATER_CONFIDENCE[0]] * 6) == 0
    assert ctl.cut([d.FIRST_CONFIDENCE[-1]] + [d.LATER_CONFIDENCE[-1]] * 6) >= 4  # a 16-token match: copy on
    ctl.calib_passed, ctl.calib_tested = [0.0] * 10, [20.0] * 10  # measured: no copy accepted
    assert ctl.cut([d.FIRST_CONFIDENCE[-1]] + [d.LATER_CONFIDENCE[-1]] * 6) == 0


def test_a_probe_of_a_free_draft_verifies_just_past_the_cut():
    """With ``probe_extra`` a probe verifies the cut plus that many positions (a free draft is
    asked for its longest copy, so a whole-draft probe costs up to n_max + 1 rows); without,
    the whole draft; outside probes the cut alone."""
    from flashdraft.adaptive import ProfitController

    costs = [0.009 * (1 + 0.8 * d) for d in range(9)]  # each row 0.8 of a step: a 0.3 draft never pays
    ctrl = ProfitController(8, verify_costs=costs)
    conf = [0.3] * 8
    assert ctrl.cut(conf) == 0
    ctrl._probing = True
    assert ctrl.cut(conf) == 8  # whole draft
    ctrl.probe_extra = 2
    assert ctrl.cut(conf) == 2 and ctrl.cut(conf[:1]) == 1
    ctrl._probing = False
    assert ctrl.cut(conf) == 0
