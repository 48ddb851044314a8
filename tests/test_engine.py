"""The decode path: attention of a few queries, eviction in blocks, and checks skipped while no
head can exceed its share; every one against its definition or the path it replaces."""

import pytest
import torch

from kvstack.cache.attention import few_queries, grouped_sdpa
from kvstack.cache.cache import KVCache
from kvstack.cache.packed import Packed
from kvstack.generate import Prompt, Runner, generate_ids
from kvstack.methods.base import decode_block


def reference_attention(query, keys, values, mask, bias, scale):
    """Softmax attention in float64, the definition: query (b, g, q, d), keys/values (b, t, d)."""
    logits = torch.einsum("bgqd,btd->bgqt", query.double(), keys.double()) * scale
    if bias is not None:
        logits = logits + bias.double()[:, None, None, :]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("bgqt,btd->bgqd", torch.softmax(logits, -1), values.double())


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("biased", [False, True])
def test_few_queries_is_softmax_attention(masked, biased):
    g = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(*s, generator=g) for s in ((2, 3, 2, 8), (2, 5, 8), (2, 5, 8)))
    mask = torch.rand(2, 1, 2, 5, generator=g) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True  # every query sees one key at least
    bias = torch.rand(2, 5, generator=g) if biased else None
    one_head = None if bias is None else bias.unsqueeze(1)
    got = few_queries(query, [keys.unsqueeze(1)], [values.unsqueeze(1)], mask, one_head, 0.35)
    torch.testing.assert_close(got.double(), reference_attention(query, keys, values, mask, bias, 0.35))


def test_few_queries_over_heads_is_each_head_alone():
    g = torch.Generator().manual_seed(3)
    query, keys, values = (torch.randn(*s, generator=g) for s in ((2, 6, 3, 8), (2, 3, 5, 8), (2, 3, 5, 8)))
    mask = torch.rand(2, 3, 3, 5, generator=g) > 0.3
    mask[..., -1] = True
    together = few_queries(query, [keys], [values], mask, None, 0.5)
    for h in range(3):
        group = slice(2 * h, 2 * h + 2)  # the query heads of KV head h
        alone = reference_attention(query[:, group], keys[:, h], values[:, h], mask[:, h : h + 1], None, 0.5)
        torch.testing.assert_close(together[:, group].double(), alone, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (2, 4), (3, 4, 5)])
def test_few_queries_over_parts_is_over_their_join(cuts):
    # a layer's decoded codes and its newest tokens are parts along t: one softmax over all of them
    g = torch.Generator().manual_seed(5)
    query, keys, values = (torch.randn(*s, generator=g) for s in ((2, 6, 1, 8), (2, 3, 7, 8), (2, 3, 7, 8)))
    mask = torch.rand(2, 3, 1, 7, generator=g) > 0.3
    mask[..., -1] = True
    edges = [0, *cuts, 7]
    parts = [slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]
    split = few_queries(query, [keys[:, :, p] for p in parts], [values[:, :, p] for p in parts], mask, None, 0.5)
    torch.testing.assert_close(split, few_queries(query, [keys], [values], mask, None, 0.5), atol=1e-6, rtol=1e-5)


def test_few_queries_by_hand():
    # one query (1, 0) over keys (1, 0) and (0, 1), scale 1: weights e/(e+1), 1/(e+1)
    query = torch.tensor([[[[1.0, 0.0]]]])
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    values = torch.tensor([[[2.0, 0.0], [0.0, 4.0]]])
    e = torch.e
    expected = torch.tensor([[[[2 * e / (e + 1), 4 / (e + 1)]]]])
    got = few_queries(query, [keys.unsqueeze(1)], [values.unsqueeze(1)], None, None, 1.0)
    torch.testing.assert_close(got, expected)
    split = few_queries(
        query, [keys[:, :1, None], keys[:, 1:, None]], [values[:, :1, None], values[:, 1:, None]], None, None, 1.0
    )
    torch.testing.assert_close(split, expected)  # the same keys in two parts: one softmax over both


@pytest.mark.parametrize("mask_shape", [None, (1, 1), (2, 1), (1, 3), (2, 3)])
@pytest.mark.parametrize("q", [1, 3])
def test_grouped_sdpa_is_few_queries(mask_shape, q):
    # a GPU's one-call path: the g query heads of a KV head as g*q queries of one head
    g = torch.Generator().manual_seed(7)
    query, keys, values = (torch.randn(*s, generator=g) for s in ((2, 6, q, 8), (2, 3, 9, 8), (2, 3, 9, 5)))
    mask = None
    if mask_shape is not None:
        mask = torch.rand(*mask_shape, q, 9, generator=g) > 0.4
        mask[..., 0] = True
    want = few_queries(query, [keys], [values], mask, None, 0.4)
    torch.testing.assert_close(grouped_sdpa(query, keys, values, mask, 0.4), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("spec", ["full", "snapkv", "kivi(bits=2, group=16)", "streaming"])
def test_a_decoding_step_never_reads_the_device(llama, spec, monkeypatch):
    # on a GPU each read (int(t), t.item(), bool(t), t.tolist()) waits for every queued kernel:
    # the model's forward pass of a decoding step that neither evicts nor encodes does none
    cache = KVCache(llama, spec, 0.5 if spec in ("snapkv", "streaming") else 1.0)
    runner, one = Runner(llama, cache), torch.ones(1, 1, dtype=torch.long)
    logits = runner.forward(torch.randint(3, 97, (1, 200)), torch.ones(1, 200, dtype=torch.long))
    for _ in range(40):  # an evicting stack checks its shares until a block leaves room for the next steps
        logits = runner.forward(logits.argmax(-1, keepdim=True), one)
        if all(layer.seen + 3 <= layer.next_check for layer in cache.layers) or cache.stack.evictor is None:
            break
    else:
        raise AssertionError("no block of eviction left room for three steps")

    def read(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    forward = llama.forward

    def guarded(*args, **kwargs):
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
                patch.setattr(torch.Tensor, name, read)
            return forward(*args, **kwargs)

    monkeypatch.setattr(llama, "forward", guarded)
    for _ in range(3):
        logits = runner.forward(logits.argmax(-1, keepdim=True), one)


def test_a_decoding_block_is_a_sixteenth_of_the_share_between_1_and_32():
    keep = torch.tensor([[8, 100, 2000]])
    assert decode_block(None, keep).tolist() == [[1, 6, 32]]
    assert decode_block(4, keep).tolist() == [[4, 4, 4]]  # a method's own cadence wins


def decode(model, spec, budget, steps, always_look=False):
    """Prefill 48 random tokens, decode `steps` more one at a time; per step (logits, counts, bytes).
    always_look: the cache before the checks were skipped (every layer looks at its counts at every step)."""
    cache = KVCache(model, spec, budget)
    if always_look:
        cache.policy.__dict__["shares_only_grow"] = False  # overrides the cached property
    runner = Runner(model, cache)
    g = torch.Generator().manual_seed(1)
    runner.forward(torch.randint(3, 97, (1, 48), generator=g), torch.ones(1, 48, dtype=torch.long))
    out = []
    for _ in range(steps):
        logits = runner.forward(torch.randint(3, 97, (1, 1), generator=g), torch.ones(1, 1, dtype=torch.long))
        counts = torch.stack([layer.counts() for layer in cache.layers if layer.is_initialized])
        out.append((logits, counts, cache.nbytes(), cache.full_nbytes()))
    return cache, out


def test_eviction_runs_in_blocks_and_the_budget_holds_at_every_step(llama):
    cache, steps = decode(llama, "keydiff", "32t", 40)
    for _, counts, _, _ in steps:
        assert int(counts.max()) <= 32  # never over the share, slack included
    # a share of 32 tokens evicts blocks of 2 (32 // 16): one compression per layer every other step
    per_layer = cache.compressions / len(cache.layers)
    assert per_layer <= 1 + 40 / 2 + 1
    most = sum(32 * layer.n_kv_heads * layer.token_bytes() for layer in cache.layers)  # slots included
    assert all(held <= most for _, _, held, _ in steps)


@pytest.mark.parametrize("spec,budget", [("keydiff", 0.5), ("tova", "24t"), ("streaming(sinks=2)", 0.25)])
def test_skipping_the_checks_changes_no_decision(tiny, spec, budget):
    fast, fast_steps = decode(tiny, spec, budget, 30)
    slow, slow_steps = decode(tiny, spec, budget, 30, always_look=True)
    assert fast.policy.shares_only_grow and not slow.policy.shares_only_grow
    for (a, ca, ba, _), (b, cb, bb, _) in zip(fast_steps, slow_steps, strict=True):
        assert torch.equal(a, b) and torch.equal(ca, cb) and ba == bb
    for x, y in zip(fast.layers, slow.layers, strict=True):
        assert torch.equal(x.dense_slots(), y.dense_slots())


def test_shares_that_may_shrink_are_always_checked(llama):
    assert not KVCache(llama, "keydiff", "64KB").policy.shares_only_grow  # a byte budget's share moves with the length
    assert not KVCache(llama, "adakv(keydiff)", 0.5).policy.shares_only_grow  # heads re-split the layer's total
    assert not KVCache(llama, "conf_kv", 0.5).policy.shares_only_grow  # the budget follows the model's confidence
    assert KVCache(llama, "keydiff+kivi(bits=4, group=16, residual=16)", 0.5).policy.shares_only_grow


def prefill_in_chunks(model, spec, budget, chunk, n=96):
    cache = KVCache(model, spec, budget)
    runner = Runner(model, cache)
    ids = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(2))
    logits = runner.prefill(ids, torch.ones_like(ids), chunk)
    return cache, logits


def test_a_full_cache_prefilled_in_chunks_gives_the_same_logits(tiny):
    whole, at_once = prefill_in_chunks(tiny, "full", 1.0, None)
    chunked, in_chunks = prefill_in_chunks(tiny, "full", 1.0, 16)
    torch.testing.assert_close(in_chunks, at_once, atol=1e-5, rtol=1e-5)
    assert chunked.nbytes() == whole.nbytes() == chunked.peak_nbytes


def test_chunked_prefill_holds_about_the_budget_plus_one_chunk(llama):
    chunked, _ = prefill_in_chunks(llama, "keydiff", "16t", 8)
    at_once, _ = prefill_in_chunks(llama, "keydiff", "16t", None)
    layer = chunked.layers[0]
    per_token = len(chunked.layers) * layer.n_kv_heads * layer.token_bytes()  # slots included
    assert chunked.peak_nbytes <= (16 + 8) * per_token  # the budget and one chunk, measured
    whole_layer = 96 * layer.n_kv_heads * layer.token_bytes(explicit_slots=False)
    assert at_once.peak_nbytes >= whole_layer + 3 * 16 * per_token / 4  # at once: a layer holds all 96 first
    assert chunked.nbytes() <= 16 * per_token


def test_a_last_chunk_of_one_token_joins_the_one_before(llama):
    cache, _ = prefill_in_chunks(llama, "full", 1.0, 19, n=39)  # 19 + 20, never 19 + 19 + 1
    assert cache.seq.prompt_end == 39 and cache.layers[0].seen == 39


def read(part):
    """A part as float32 tokens: codes (`Packed`) decoded as the kernel reads them."""
    return part.decode() if isinstance(part, Packed) else part.float()


@pytest.mark.parametrize("spec", ["kivi(bits=2, group=8, residual=8)", "keydiff+adaquant(group=8, residual=8)"])
def test_heads_alike_decode_in_one_call_as_each_head_alone(llama, spec):
    budget = 0.5 if spec.startswith("keydiff") else 1.0
    cache, _ = decode(llama, spec, budget, 12)
    checked = 0
    for layer in cache.layers:
        both = layer.layer_kv()
        if both is None:
            continue
        keys, values = (torch.cat([read(p) for p in parts], dim=2) for parts in both)
        for h in range(layer.n_kv_heads):  # the same numbers (float32 here, the model's dtype there)
            assert torch.equal(keys[:, h].to(layer.head_keys(h).dtype), layer.head_keys(h))
            assert torch.equal(values[:, h].to(layer.head_values(h).dtype), layer.head_values(h))
        checked += layer.is_coded
    assert checked > 0  # some layer held encoded tokens and was decoded in one call


def test_a_layer_of_ragged_heads_attends_head_by_head(llama):
    cache, _ = decode(llama, "adakv(keydiff)", 0.25, 4)
    ragged = [layer for layer in cache.layers if len({int(x) for x in layer.counts()[0]}) > 1]
    assert ragged and all(layer.layer_kv() is None for layer in ragged)


def test_each_chunk_is_scored_by_the_question_run_after_it(llama):
    """Query-aware chunked prefill: before each chunk's compression a probe runs the question after
    what the cache holds and lends its queries (SnapKV scores by them); the cache never stores the
    probe's tokens, and it holds at most the budget plus one chunk."""
    g = torch.Generator().manual_seed(3)
    context, question = torch.randint(3, 97, (1, 90), generator=g), torch.randint(3, 97, (1, 6), generator=g)
    ids = torch.cat([context, question], dim=1)
    cache = KVCache(llama, "snapkv(window_size=4)", "16t")
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    compress = cache.policy.compress_layer

    def spy(layer, keep, decoding=False):
        seen.append((layer.seen, layer.query_slots.clone(), layer.queries.clone()))
        compress(layer, keep, decoding)

    cache.policy.compress_layer = spy
    Runner(llama, cache).prefill(ids, torch.ones_like(ids), 16, (question, torch.ones_like(question)))
    assert cache.layers[0].seen == 96 and cache.seq.prompt_end == 96  # the probes' tokens were never stored
    first = [(slots, queries) for end, slots, queries in seen if end == 32]  # 16 tokens fit 16t: none sooner
    assert len(first) == len(cache.layers)
    for end, slots, _ in seen:  # every chunk wholly before the question: scored by the question after it
        expected = torch.arange(end + 2, end + 6) if end <= 90 else torch.arange(92, 96)
        assert slots.tolist() == expected.tolist()
    # the first compression's probe ran over the first two chunks as they came (nothing was evicted
    # yet): the queries of a full cache reading them and then the question
    alone = KVCache(llama, "full", 1.0, query_window=4)
    both = torch.cat([context[:, :32], question], dim=1)
    Runner(llama, alone).forward(both, torch.ones_like(both))
    for layer, (slots, queries) in zip(alone.layers, first, strict=True):
        assert layer.query_slots.tolist() == slots.tolist()
        torch.testing.assert_close(queries, layer.queries, atol=1e-5, rtol=1e-5)
    layer = cache.layers[0]
    per_token = len(cache.layers) * layer.n_kv_heads * layer.token_bytes()
    assert cache.peak_nbytes <= (16 + 16) * per_token and cache.nbytes() <= 16 * per_token


def test_a_stack_that_reads_no_queries_is_not_probed(llama, monkeypatch):
    """KeyDiff scores keys alone: chunked prefill with a question runs no probe."""

    def fail(*args):
        raise AssertionError("probed")

    monkeypatch.setattr(Runner, "probe", fail)
    ids = torch.randint(3, 97, (1, 64), generator=torch.Generator().manual_seed(4))
    cache = KVCache(llama, "keydiff", "16t")
    Runner(llama, cache).prefill(ids, torch.ones_like(ids), 16, (ids[:, -6:], torch.ones(1, 6, dtype=torch.long)))
    assert cache.layers[0].seen == 64
    with pytest.raises(AssertionError, match="probed"):
        snap = KVCache(llama, "snapkv(window_size=4)", "16t")
        Runner(llama, snap).prefill(ids, torch.ones_like(ids), 16, (ids[:, -6:], torch.ones(1, 6, dtype=torch.long)))


def test_a_batch_with_a_row_without_question_is_not_probed(llama, monkeypatch):
    """A probe would score that row's chunks by padding: with one such row, chunks compress as before."""
    probed = []
    monkeypatch.setattr(Runner, "probe", lambda self, ids, mask: probed.append(ids.shape))
    context = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    asked = [Prompt(context, [5, 6, 7]), Prompt(context[:50], [8, 9])]
    run = dict(stack="snapkv(window_size=4)", budget="16t", max_new_tokens=2, prefill_chunk=16)
    generate_ids(llama, asked, **run)
    assert probed == [(2, 3)] * 3  # chunks ending at 16, 32, 48: before every row's question
    probed.clear()
    generate_ids(llama, [asked[0], Prompt(context[:50], [])], **run)
    assert probed == []
