"""Synthetic acceptance (llama-server's ``--spec-synth-rates`` / ``--spec-synth-len``): a
benchmarking mode where a coin accepts drafts; the rates it is given are the rates it gets,
rate 0 is plain decoding, and bad settings are refused with the flag's name."""

from __future__ import annotations

import pytest
from tiny import tiny_target

from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.engine import EngineConfig
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.server.cli import build_parser, engine_config_from_args
from flashdraft.synthetic import accept_probs

PROMPT = [3, 14, 15, 9, 26, 5, 35, 8]


def test_rates_become_conditional_probabilities_and_a_length_its_rates():
    assert accept_probs([0.8, 0.4, 0.1, 0.0], None, 4) == pytest.approx([0.8, 0.5, 0.25, 0.0])
    assert accept_probs([0.0, 0.0], None, 2) == [0.0, 0.0]
    assert accept_probs(None, None, 4) is None
    for length in (1.0, 2.5, 4.0, 9.0):
        probs = accept_probs(None, length, 8)
        rates, r = [], 1.0
        for p in probs:
            r *= p
            rates.append(r)
        assert 1 + sum(rates) == pytest.approx(length, abs=1e-6)  # the mean acceptance length asked for


@pytest.mark.parametrize("rates,length,n,words", [
    ([0.5, 0.6], None, 2, "non-increasing"), ([0.5], None, 2, "must hold 2 values"),
    ([1.5, 0.5], None, 2, "within [0, 1]"), (None, 9.5, 8, "within [1, 9]"), ([0.5], 2.0, 1, "mutually exclusive"),
])
def test_bad_settings_are_refused_by_flag(rates, length, n, words):
    with pytest.raises(ValueError, match="--spec-synth") as e:
        accept_probs(rates, length, n)
    assert words in str(e.value)


def test_serve_flags_reach_the_engine_and_need_a_drafter():
    args = build_parser().parse_args("--spec-type ngram --spec-draft-n-max 2 --spec-synth-rates 0.9,0.3".split())
    cfg = engine_config_from_args(args)
    assert cfg.synth_accept() == pytest.approx([0.9, 1 / 3])
    with pytest.raises(ValueError, match="needs a drafter"):
        EngineConfig(spec_type="none", synth_len=1.5, n_draft=4).synth_accept()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--spec-synth-rates", "0.9,x"])


def _run(synth, seed=4242, temperature=0.2, n=48):
    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    # block size 5: a draft of 4 tokens every step
    drafter = DFlashDrafter(random_dflash_model(target.model, 1, 5), target.embed_tokens, target.lm_head)
    gen = SpeculativeGenerator(target, drafter, n_draft=4, synth_accept=synth)
    return generate_text(gen, PROMPT, n, SamplingParams(temperature=temperature, top_k=5, seed=seed), ignore_eos=True)


def test_rate_zero_is_plain_decoding_and_rate_one_takes_every_draft():
    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    plain = generate_text(SpeculativeGenerator(target), PROMPT, 48,
                          SamplingParams(temperature=0.2, top_k=5, seed=4242), ignore_eos=True)[1]
    _, ids, _, t = _run([0.0] * 4)
    assert ids == plain and t.draft_n > 0 and t.draft_n_accepted == 0
    _, ids, _, t = _run([1.0] * 4)
    assert t.draft_n > 0 and t.draft_n_accepted == t.draft_n  # the random drafter's drafts, all taken
    assert ids != plain


def test_the_measured_acceptance_follows_the_rates_and_repeats_for_a_seed():
    rates = [0.9, 0.6, 0.3, 0.1]
    runs = [_run(accept_probs(rates, None, 4), seed=s, n=200)[3] for s in range(6)]
    drafted = [sum(t.drafted_per_position[k] for t in runs) for k in range(4)]
    accepted = [sum(t.accepted_per_position[k] for t in runs) for k in range(4)]
    # drafts reach position k only after k accepted ones: acceptance at k / steps ~ rates[k]
    for k, r in enumerate(rates):
        assert accepted[k] / drafted[0] == pytest.approx(r, abs=0.08), (k, accepted, drafted)
    again = _run(accept_probs(rates, None, 4), seed=3, n=200)[3]
    assert (again.draft_n, again.draft_n_accepted) == (runs[3].draft_n, runs[3].draft_n_accepted)
