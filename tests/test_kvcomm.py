"""KVCOMM's anchors: a document corrected by the deviation observed after the same prefix is the
full prefill's (by definition); after another prefix it is corrected, not replaced."""

import torch

from kvstack.generate import compress_ids
from kvstack.reuse import kvcomm
from kvstack.reuse.kvlink import join


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


A, B, C = tokens(24, 1), tokens(18, 2), tokens(30, 3)


def held(cache):
    """Per layer (keys, values) of the dense view, float32."""
    return [(x.dense(list(x.keys)).float(), x.dense(list(x.values)).float()) for x in cache.layers]


def test_an_anchor_from_the_same_prefix_gives_the_full_prefill(tiny):
    full = compress_ids(tiny, A + B)
    docs = [(A, compress_ids(tiny, A)), (B, compress_ids(tiny, B))]
    joined = kvcomm.join(tiny, docs, [None, kvcomm.anchor(tiny, A, B)])
    for (k, v), (rk, rv) in zip(held(joined), held(full), strict=True):
        n = rk.shape[2]  # a sliding layer: the joined one still holds what its next step trims
        torch.testing.assert_close(k[..., -n:, :], rk, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[..., -n:, :], rv, atol=1e-5, rtol=1e-5)


def test_an_anchor_from_another_prefix_moves_the_document_toward_its_place(llama):
    """Anchored after C, applied after A: the document's deviation is turned to its new positions;
    without an anchor the join is KVLink's."""
    docs = [(A, compress_ids(llama, A)), (B, compress_ids(llama, B))]
    plain = join(llama, docs)
    corrected = kvcomm.join(llama, docs, [None, kvcomm.anchor(llama, C, B)])
    untouched = kvcomm.join(llama, docs, [None, None])
    for (k, _v), (pk, pv), (uk, uv) in zip(held(corrected), held(plain), held(untouched), strict=True):
        assert torch.equal(uk, pk) and torch.equal(uv, pv)
        assert torch.equal(k[..., : len(A), :], pk[..., : len(A), :])  # the first document as it was
    last = held(corrected)[-1][0][..., len(A) :, :]
    assert not torch.allclose(last, held(plain)[-1][0][..., len(A) :, :])
