"""KVLink's join of documents cached apart (and RelayCaching's recomputation through it): against
a full prefill of the concatenation where the definition makes them equal, and bytes summed."""

import pytest
import torch

from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.generate import Runner, resume
from kvstack.reuse.kvlink import join

SNAP = "snapkv(window_size=4, every=4)"


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


DOCS = [tokens(24, 1), tokens(18, 2), tokens(20, 3)]


def cached(model, ids, spec="full", budget=1.0):
    runner = Runner(model, KVCache(model, spec, budget))
    runner.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    runner.cache.last_logits = runner.last_logits
    return runner.cache


def ask(model, cache, question):
    """Logits (q, vocab) of the question's tokens after what `cache` holds."""
    runner = resume(model, cache)
    q = torch.tensor([question])
    return runner.forward(q, torch.ones_like(q), at=torch.arange(len(question) - 1))[0]


def test_one_document_joined_is_the_document(tiny):
    for spec, budget in (("full", 1.0), (SNAP, 0.5)):
        doc = cached(tiny, DOCS[0], spec, budget)
        joined = join(tiny, [(DOCS[0], doc)])
        assert joined.nbytes() <= doc.nbytes()  # the same tensors, compacted if a view kept more alive
        torch.testing.assert_close(ask(tiny, joined, tokens(6, 9)), ask(tiny, doc, tokens(6, 9)), atol=0, rtol=0)


def test_reencoded_keys_of_the_first_layer_are_the_full_prefills(llama):
    """Layer 0's keys and values depend on a token and its position only: re-encoded, they are a
    full prefill's; not re-encoded, the later document's keys sit at the wrong positions."""
    full = cached(llama, DOCS[0] + DOCS[1])
    docs = [(ids, cached(llama, ids)) for ids in DOCS[:2]]
    for reencode in (True, False):
        layer, ref = join(llama, docs, reencode=reencode).layers[0], full.layers[0]
        assert torch.equal(layer.dense_slots(), ref.dense_slots())
        torch.testing.assert_close(layer.dense(list(layer.values)), ref.dense(list(ref.values)), atol=1e-6, rtol=0)
        same = torch.allclose(layer.dense(list(layer.keys)), ref.dense(list(ref.keys)), atol=1e-5, rtol=0)
        assert same == reencode


def test_recomputing_every_later_token_is_the_full_prefill(tiny):
    """RelayCaching at its limit: the later documents wholly recomputed over the first, which is the
    full prefill's own prefix, give the full prefill's cache (and the same next-token logits)."""
    ids = DOCS[0] + DOCS[1] + DOCS[2]
    full = cached(tiny, ids)
    joined = join(tiny, [(d, cached(tiny, d)) for d in DOCS], relay=100)
    question = tokens(5, 7)
    torch.testing.assert_close(ask(tiny, joined, question), ask(tiny, full, question), atol=1e-5, rtol=1e-5)


def test_link_tokens_see_the_earlier_documents(llama):
    docs = [(d, cached(llama, d)) for d in DOCS[:2]]
    plain, linked = join(llama, docs), join(llama, docs, link=3)
    last = [layer.layer_idx for layer in plain.layers][-1]
    a, b = plain.layers[last], linked.layers[last]
    n = len(DOCS[0]) + len(DOCS[1])
    assert torch.equal(a.dense_slots(), b.dense_slots())
    assert torch.allclose(a.dense(list(a.keys))[..., : n - 3, :], b.dense(list(b.keys))[..., : n - 3, :])
    assert not torch.allclose(a.dense(list(a.keys))[..., n - 3 :, :], b.dense(list(b.keys))[..., n - 3 :, :])
    assert linked.seq.exempt == [(n - 3, n)]  # kept whole


@pytest.mark.parametrize("spec", [SNAP, f"{SNAP}+kivi(bits=2, group=8, residual=0)", "h2o"])
def test_compressed_documents_join_with_their_bytes(tiny, spec):
    docs = [(d, cached(tiny, d, spec, 0.5)) for d in DOCS]
    held = sum(c.nbytes() for _, c in docs)
    joined = join(tiny, docs, reencode=False)
    # a layer where a document kept all its tokens (slots implicit, zero bytes) lists them once joined
    slots = 4 * sum(layer.head_len(h) for layer in joined.layers for h in range(layer.n_kv_heads))
    assert held <= joined.nbytes() <= held + slots
    turned = join(tiny, docs)  # encoded keys turned are encoded again: their groups whole again
    assert turned.nbytes() == pytest.approx(joined.nbytes(), rel=0.05)
    assert joined.layers[0].seen == sum(len(d) for d in DOCS)
    logits = ask(tiny, joined, tokens(6, 9))
    assert torch.isfinite(logits).all()
    assert joined.nbytes() <= 0.5 * joined.full_nbytes() + 6 * joined.layers[0].token_bytes() * 2 * len(joined.layers)


def test_what_cannot_be_joined_is_refused(llama):
    a = (DOCS[0], cached(llama, DOCS[0], SNAP, 0.5))
    with pytest.raises(UserError, match="one stack"):
        join(llama, [a, (DOCS[1], cached(llama, DOCS[1], "h2o", 0.5))])
    with pytest.raises(UserError, match="shares storage across layers"):
        join(llama, [(DOCS[0], cached(llama, DOCS[0], "minicache", 1.0))])
    with pytest.raises(UserError, match="compensation"):
        doc = cached(llama, DOCS[0], f"razor({SNAP})", 0.5)
        join(llama, [(DOCS[0], doc), (DOCS[1], cached(llama, DOCS[1], f"razor({SNAP})", 0.5))])
    with pytest.raises(UserError, match="nothing to join"):
        join(llama, [])


def test_a_sink_cached_ahead_is_left_out_of_the_join(llama):
    """Each later document cached after the prompt's first tokens: the join holds the documents
    only, at the full prefill's slots, and layer 0 (context-free) equals the full prefill's."""
    from kvstack.reuse.kvlink import sink_prefix

    docs = sink_prefix(DOCS[:2], 4)
    assert docs[1] == DOCS[0][:4] + DOCS[1]
    joined = join(llama, [(d, cached(llama, d)) for d in docs], sink=4)
    full = cached(llama, DOCS[0] + DOCS[1])
    layer, ref = joined.layers[0], full.layers[0]
    assert joined.layers[0].seen == len(DOCS[0]) + len(DOCS[1]) and joined.nbytes() == full.nbytes()
    assert torch.equal(layer.dense_slots(), ref.dense_slots())
    torch.testing.assert_close(layer.dense(list(layer.keys)), ref.dense(list(ref.keys)), atol=1e-5, rtol=0)
    torch.testing.assert_close(layer.dense(list(layer.values)), ref.dense(list(ref.values)), atol=1e-6, rtol=0)
