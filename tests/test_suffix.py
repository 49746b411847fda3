"""The suffix tree, the suffix drafter (SuffixDecoding) and its per-client past answers."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdraft.drafters.suffix import SuffixDrafter, SuffixStore, client_key
from flashdraft.drafters.suffix_tree import SuffixTree
from flashdraft.sampling import SamplingParams

GREEDY = SamplingParams()


def substrings(seqs, max_len):
    """Brute force: {substring: occurrences} of every substring of at most ``max_len`` tokens."""
    out = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + max_len) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def tree_counts(tree):
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for tok, child in node.children.items():
            out[path + (tok,)] = child.count
            stack.append((path + (tok,), child))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=4), st.integers(2, 6))
def test_tree_counts_every_substring_up_to_its_depth(seqs, depth):
    tree = SuffixTree(depth)
    for s in seqs:
        tree.add(s)
    assert tree_counts(tree) == substrings(seqs, depth)
    assert len(tree) == sum(map(len, seqs))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 7))
def test_extend_in_pieces_equals_one_add(seq, cut):
    whole, pieces = SuffixTree(5), SuffixTree(5)
    whole.add(seq)
    for i in range(0, len(seq), cut):
        pieces.extend(seq[i:i + cut])
    assert tree_counts(pieces) == tree_counts(whole)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=2, max_size=5))
def test_remove_takes_out_exactly_one_sequence(seqs):
    tree = SuffixTree(4)
    for s in seqs:
        tree.add(s)
    tree.remove(seqs[0])
    assert tree_counts(tree) == substrings(seqs[1:], 4)
    for s in seqs[1:]:
        tree.remove(s)
    assert tree.root.children == {} and len(tree) == 0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=40))
def test_match_is_the_longest_earlier_suffix_with_a_continuation(seq):
    # the request tree holds the sequence itself: only earlier occurrences can continue it
    tree = SuffixTree(8)
    tree.extend(seq)
    m, _ = tree.match(seq, 7)
    want = 0
    for k in range(1, min(7, len(seq) - 1) + 1):
        suffix = seq[-k:]
        if any(seq[i:i + k] == suffix for i in range(len(seq) - k)):  # an occurrence with a next token
            want = k
    assert m == want


def test_speculate_follows_the_most_frequent_continuation():
    tree = SuffixTree(16)
    for s in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 5], [9, 2, 3, 7]):
        tree.add(s)
    spec = tree.speculate([0, 1, 2], n=8, factor=2.0, min_prob=0.0)
    # matched [1, 2] (3 times, all continue with 3, 4); then 5 (2 of 3) over 6
    assert spec.match == 2 and spec.tokens == [3, 4, 5]
    assert spec.score == pytest.approx(1 + 1 + 2 / 3)
    # the depth scales with the match: factor 1 drafts at most as many tokens as matched
    assert tree.speculate([0, 1, 2], n=8, factor=1.0, min_prob=0.0).tokens == [3, 4]
    # the floor: the path through 5 has probability 2/3 < 0.7
    assert tree.speculate([0, 1, 2], n=8, factor=2.0, min_prob=0.7).tokens == [3, 4]
    # after [2, 3] the continuation splits 3 ways (4, 4, 4, 7): 4 has 3/4
    spec = tree.speculate([5, 2, 3], n=1, factor=4.0, min_prob=0.0)
    assert spec.tokens == [4] and spec.score == pytest.approx(0.75)
    assert tree.speculate([8, 8], n=4).tokens == []
    assert tree.speculate([1, 2], n=0).tokens == []


def test_tree_depth_bounds_match_plus_draft():
    tree = SuffixTree(4)
    tree.add(list(range(20)))
    spec = tree.speculate([0, 1, 2, 3, 4, 5], n=10, factor=10.0, min_prob=0.0, max_match=3)
    assert spec.match == 3 and spec.tokens == [6]  # 3 matched + 1 drafted = the depth
    # by default the match leaves room for the drafts: 1 matched + 3 drafted
    spec = tree.speculate([0, 1, 2, 3, 4, 5], n=10, factor=10.0, min_prob=0.0)
    assert spec.match == 1 and spec.tokens == [6, 7, 8]
    with pytest.raises(ValueError):
        SuffixTree(1)


def test_store_is_bounded_and_evicts_oldest_first():
    store = SuffixStore(max_answers=2, max_depth=8)
    store.add("a", [1, 2, 3, 4])
    store.add("b", [5, 6, 7])
    store.add("a", [1, 2, 9, 9])
    assert len(store) == 2 and set(store.trees) == {"a", "b"}
    assert store.speculate("a", [1, 2], 4, 2.0, 0.0).tokens == [9, 9]  # [1, 2, 3, 4] is gone
    store.add("a", [8])
    assert set(store.trees) == {"a"}  # b's only answer went: its tree with it
    assert SuffixStore(0).speculate("a", [1], 4, 1.0, 0.0).tokens == []
    with pytest.raises(ValueError):
        SuffixStore(-1)


def test_never_proposes_from_another_clients_answers():
    store = SuffixStore(max_answers=64)
    alice, bob = client_key("key-alice"), client_key("key-bob")
    assert alice != bob and alice is not None and client_key("") is None and client_key(None) is None
    secret = [11, 12, 13, 14, 15, 16, 17, 18]
    context = torch.tensor([1, 2, 11, 12, 13, 14])

    a = SuffixDrafter(store)
    a.reset()
    a.start_request(alice)
    a.finish_request(torch.tensor([1, 2] + secret), 2)  # alice's answer
    # the same context from bob, or from a request without a key, never gets alice's tokens
    for client in (bob, None):
        b = a.fork()
        b.start_request(client)
        assert b.propose(context, 8, GREEDY, None).tokens.tolist() == []
    again = a.fork()
    again.start_request(alice)
    assert again.propose(context, 4, GREEDY, None).tokens.tolist() == [15, 16, 17, 18]


def test_drafter_uses_its_own_request_and_starts_over_on_another_sequence():
    d = SuffixDrafter(SuffixStore(0), factor=2.0)
    seq = [7, 1, 2, 3, 4, 8, 1, 2]
    assert d.propose(torch.tensor(seq), 8, GREEDY, None).tokens.tolist() == [3, 4, 8, 1]
    seq += [3, 4]  # the committed sequence grows: the tree is extended, not rebuilt
    # matched [1, 2, 3, 4] (4 tokens, 8 allowed): what followed it, to the end of the sequence
    assert d.propose(torch.tensor(seq), 8, GREEDY, None).tokens.tolist() == [8, 1, 2, 3, 4]
    # a different sequence (no prefix in common): nothing of the old one is drafted
    assert d.propose(torch.tensor([5, 6, 3, 4]), 8, GREEDY, None).tokens.tolist() == []
    with pytest.raises(ValueError):
        SuffixDrafter(factor=0)
    with pytest.raises(ValueError):
        SuffixDrafter(min_prob=1.5)


def test_matches_brute_force_draft_on_random_text():
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(300)]
    tree = SuffixTree(12)
    tree.extend(seq)
    spec = tree.speculate(seq, n=10, factor=3.0, min_prob=0.0)
    # brute force: the most frequent next token after every earlier occurrence of the match
    k = spec.match
    follows = [seq[i + k] for i in range(len(seq) - k) if seq[i:i + k] == seq[-k:]]
    counts = {t: follows.count(t) for t in set(follows)}
    assert spec.tokens[0] == max(counts, key=counts.get)


def test_server_keys_requests_by_their_api_key():
    from flashdraft.server.clients import client_of

    assert client_of({"authorization": "Bearer k1"}) == client_key("k1")
    assert client_of({"authorization": "bearer  k1 "}) == client_key("k1")
    assert client_of({"x-api-key": "k2"}) == client_key("k2") != client_key("k1")
    assert client_of({}) is None and client_of({"authorization": "Basic abc"}) is None


@pytest.mark.real
def test_greedy_output_equals_plain_decoding_on_the_real_model():
    from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, load_drafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.prompts import SEED_PROMPTS
    from flashdraft.targets.torch import Target

    target = Target.load()
    texts = [SEED_PROMPTS[2], "Write a Python function that reverses the words of a sentence."]
    prompts = [target.chat_prompt_ids([{"role": "user", "content": p}]) for p in texts]
    n = 48
    base = [generate_text(SpeculativeGenerator(target), ids, n, GREEDY)[1] for ids in prompts]
    dflash = str(DEFAULT_DRAFTER_DIR) if (DEFAULT_DRAFTER_DIR / "config.json").exists() else "random"
    for cfg in (EngineConfig(spec_type="suffix"), EngineConfig(spec_type="hybrid", lookup="suffix", draft_model=dflash)):
        drafter = load_drafter(cfg, target)
        store = drafter.store if cfg.spec_type == "suffix" else drafter.ngram.store
        gen = SpeculativeGenerator(target, drafter, n_draft=15)
        k1, k2 = client_key("one"), client_key("two")
        first = generate_text(gen, prompts[0], n, GREEDY, client=k1)
        assert first[1] == base[0], cfg.spec_type
        assert set(store.trees) == {k1}  # the finished answer, under its client only
        # the same prompt again: its past answer is drafted (and output is still the target's)
        again = generate_text(gen, prompts[0], n, GREEDY, client=k1)
        assert again[1] == base[0]
        if cfg.spec_type == "suffix":
            assert again[3].draft_n_accepted > first[3].draft_n_accepted
            assert again[3].draft_n_accepted >= n // 2
        other = generate_text(gen, prompts[1], n, GREEDY, client=k2)
        assert other[1] == base[1]
        assert set(store.trees) == {k1, k2}


@pytest.mark.parametrize("n_parallel", [1, 2])
def test_server_keeps_each_api_keys_answers_apart(n_parallel):
    # over real HTTP: each request's bearer key reaches the drafter, whose store then holds
    # one tree per key, with that key's answers only
    import httpx
    from inproc import PROMPT, chat_target, serve

    from flashdraft.generate import SpeculativeGenerator

    store = SuffixStore(16)
    gen = SpeculativeGenerator(chat_target(), SuffixDrafter(store), ctx_size=256, n_draft=4)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with serve(gen, n_parallel=n_parallel, spec_type="suffix") as url:
        texts = {}
        for key in ("alice", "bob", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            texts[key] = r.json()["choices"][0]["text"]
    assert set(store.trees) == {client_key("alice"), client_key("bob"), None}
    assert len(set(texts.values())) == 1  # the same greedy answer for every key
    answer = store._order[0][1]
    for key in ("alice", "bob", None):
        tree = store.trees[client_key(key)]
        assert len(tree) == len(answer)  # one answer each, never another key's as well
