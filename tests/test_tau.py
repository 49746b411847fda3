"""τ (``acceptance_length``) on the real SmolLM2 for every drafter: a short greedy answer
that ends on end-of-sequence reads ≥ 1.0, plain decoding exactly 1.0, and the server's
timings, the bench's counters and ``flashdraft eval``'s counters agree."""

from __future__ import annotations

import pytest

from flashdraft.bench.measure import counts_from_timings
from flashdraft.engine import DEFAULT_DRAFTER_DIR, SPEC_TYPES, EngineConfig, load_drafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target
from flashdraft.train.evaluate import AcceptanceStats, _run_one

pytestmark = pytest.mark.real

SHORT = "Name three colors."


@pytest.fixture(scope="module")
def target():
    return Target.load()


@pytest.mark.parametrize("spec_type", SPEC_TYPES)
def test_tau_at_least_one_on_an_answer_ending_on_eos(target, spec_type):
    draft_model = {"dflash": str(DEFAULT_DRAFTER_DIR), "hybrid": str(DEFAULT_DRAFTER_DIR),
                   "draft": "target"}.get(spec_type)

    def fresh() -> SpeculativeGenerator:  # the suffix drafter remembers past answers: each run starts anew
        drafter = load_drafter(EngineConfig(spec_type=spec_type, draft_model=draft_model), target)
        return SpeculativeGenerator(target, drafter, n_draft=7, controller=None)

    gen = fresh()
    ids = target.chat_prompt_ids([{"role": "user", "content": SHORT}])
    text, out, finish, t = generate_text(gen, ids, 200, SamplingParams())
    assert finish == "stop" and 1 < t.predicted_n < 200, text  # it ended on end-of-sequence
    tau = t.acceptance_length
    assert tau >= 1.0
    # every verify step counted, the one that produced the end-of-sequence token included
    assert sum(t.step_hist) == t.n_steps - 1 and t.verify_n == t.predicted_n - 1 + 1
    if spec_type == "none":
        assert tau == 1.0 and t.step_hist == [t.n_steps - 1]
    else:
        assert t.draft_n > 0
    if spec_type == "draft":  # the target drafting for itself: right up to the end of sequence
        assert tau > 2
    # the bench and `flashdraft eval` read the same τ off the same run
    assert counts_from_timings(t).tau() == pytest.approx(tau)
    stats = AcceptanceStats()
    _run_one(fresh(), ids, 200, SamplingParams(), False, stats)
    assert stats.to_dict(8)["tau"] == pytest.approx(tau, abs=1e-4)
