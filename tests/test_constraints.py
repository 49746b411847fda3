"""Constrained speculative decoding (llguidance): the constrained target's output, in every mode.

Tiny byte-level random models here (letters, digits, space); the real model and the server's
JSON-schema / grammar fields are tested in ``test_structured_output.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
from scipy.stats import chi2_contingency

from flashdraft.constraints import Constraint, GrammarError, TokenizerInfo, compile_grammar
from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import SpeculativeGenerator
from flashdraft.sampling import SamplingParams
from tiny import tiny_byte_target

GREEDY = SamplingParams()
REGEX = r"(ab|cd|e)+ [0-9]{2,4}"
GBNF = 'root ::= item ("," item)*\nitem ::= [a-f]+ | "x" [0-9]'


def _drafters(target):
    return {"none": None, "ngram": NgramDrafter(),
            "dflash": DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=6),
                                    target.embed_tokens, target.lm_head)}


def _run(target, drafter, grammar, prompt, n=24, params=GREEDY) -> tuple[str, list[int], object]:
    constraint = Constraint(TokenizerInfo.for_target(target), grammar)
    gen = SpeculativeGenerator(target, drafter, n_draft=5)
    text, ids, t = "", [], None
    for step in gen.generate(prompt, n, params, constraint=constraint):
        text += step.text
        ids += step.token_ids
        t = step.timings or t
    return text, ids, t


@pytest.mark.parametrize("kind,source", [("regex", REGEX), ("gbnf", GBNF)])
def test_greedy_constrained_output_is_identical_in_every_mode(kind, source):
    target = tiny_byte_target("llama", seed=3)
    grammar = compile_grammar(kind, source)
    prompt = target.encode("ab cd ab cd ab")
    outs = {name: _run(target, d, grammar, prompt) for name, d in _drafters(target).items()}
    base = outs["none"]
    # what came out is in the grammar's language (a prefix of a sentence when cut by length)
    assert Constraint(TokenizerInfo.for_target(target), grammar).valid_prefix(base[1]) == len(base[1]) > 0
    for name, out in outs.items():
        assert out[1] == base[1], name
    assert outs["dflash"][2].draft_n > 0  # drafts were proposed (and masked), not skipped
    free = SpeculativeGenerator(target).generate(prompt, 24, GREEDY)
    assert "".join(s.text for s in free) != base[0]  # the grammar changed the answer


def test_constrained_answer_ends_when_the_grammar_is_complete():
    target = tiny_byte_target("qwen3", seed=4)
    text, ids, t = _run(target, _drafters(target)["dflash"], compile_grammar("regex", "(yes|no)"),
                        target.encode("q"), n=20)
    assert text in ("yes", "no") and len(ids) == len(text)


def test_sampled_constrained_distribution_is_the_same_in_every_mode():
    """T=1: the first two letters' joint frequencies under the grammar agree between plain
    decoding and each drafter (two-sample chi-square); every answer matches the grammar."""
    target = tiny_byte_target("llama", seed=5)
    grammar = compile_grammar("regex", "[a-d][a-d][a-d]+")
    prompt = target.encode("abcd")
    counts = {}
    for name, drafter in _drafters(target).items():
        c = torch.zeros(16)
        for seed in range(150):
            text, _, _ = _run(target, drafter, grammar, prompt, n=3, params=SamplingParams(temperature=1.0, seed=seed))
            assert re.fullmatch("[a-d]{3}", text), (name, text)
            c[(ord(text[0]) - 97) * 4 + ord(text[1]) - 97] += 1
        counts[name] = c
    for name in ("ngram", "dflash"):
        table = torch.stack([counts["none"], counts[name]])
        table = table[:, table.sum(0) >= 8]
        assert chi2_contingency(table.numpy()).pvalue > 1e-3, name


def test_bad_grammars_are_refused_with_the_reason():
    for kind, text, words in (("gbnf", "root ::= this is (not valid", "Expected ')'"),
                              ("json_schema", {"type": "nonsense"}, "nonsense"),
                              ("regex", "a(b", ""), ("xml", "x", "unknown grammar kind")):
        with pytest.raises(GrammarError) as e:
            compile_grammar(kind, text)
        assert words in str(e.value)
