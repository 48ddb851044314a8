"""KVzip: its reconstruction prompts, its scores against eager attention, and what it keeps."""

import torch

from helpers import layer_with, observe
from kvstack.cache.cache import KVCache
from kvstack.generate import Runner
from kvstack.methods.evict.kvzip import reconstruction_chunks
from kvstack.methods.select import select
from kvstack.stack import Stack


def test_reconstruction_chunks_follow_the_papers_prompts():
    # chunk 4, overlap 2: the second chunk restarts from the last 2 tokens of the first
    got = reconstruction_chunks(list(range(10, 20)), 4, repeat=[1], repeat_part=[2, 3], overlap=2)
    assert got == [[1, 10, 11, 12, 13], [2, 3, 12, 13, 14, 15, 16, 17], [2, 3, 16, 17, 18, 19]]


def test_kvzip_keeps_the_sinks_then_the_best_reconstruction_scores():
    layer = layer_with(torch.randn(1, 1, 8, 4))
    layer.add_stat("reconstruction", 0, torch.tensor([[0.0, 0.0, 0.9, 0.1, 0.8, 0.2, 0.3, 0.05]]), accumulate=False)
    method = Stack.parse("kvzip(sinks=2)").evictor
    obs = observe(layer, 4)
    decision = select(method.score(obs), obs.valid, obs.slots, obs.keep)
    assert decision.index[0, 0].tolist() == [0, 1, 2, 4]  # sinks 0, 1 despite score 0; then 0.9 and 0.8


def test_reread_scores_are_the_max_attention_of_the_reconstruction_queries(llama):
    context = torch.randint(3, 90, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    repeat = [5, 6, 7]
    llama._kvstack_repeat_ids = (repeat, [8])
    try:
        cache = KVCache(llama, "full", 1.0, observe=frozenset({"reconstruction"}))
        runner = Runner(llama, cache)
        runner.forward(torch.tensor([context]), torch.ones(1, 30, dtype=torch.long))  # re-reads after the prompt
        assert cache.reread_s > 0 and not cache.policy.waiting
    finally:
        del llama._kvstack_repeat_ids
    # the definition, with eager attention over context + "repeat" + context in one pass
    llama.set_attn_implementation("eager")
    try:
        ids = torch.tensor([context + repeat + context])
        with torch.no_grad():
            attn = llama(ids, output_attentions=True).attentions  # per layer (1, 4 query heads, q, k)
    finally:
        llama.set_attn_implementation("kvstack")
    for layer, probs in zip(cache.layers, attn, strict=True):
        rows = probs[0, :, 30:, :30]  # reconstruction queries -> context keys
        for h in range(layer.n_kv_heads):
            expected = rows[2 * h : 2 * h + 2].amax(dim=(0, 1))  # group of 2 query heads per KV head
            torch.testing.assert_close(layer.stats["reconstruction"][h][0], expected, atol=1e-5, rtol=1e-4)


def test_decoding_without_the_rereading_pass_is_a_one_line_error(llama):
    import pytest

    from kvstack.errors import UserError

    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = KVCache(llama, "kvzip", 0.5)
    with torch.no_grad(), pytest.raises(UserError, match="kvstack.generate"):
        llama.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, past_key_values=cache, pad_token_id=0
        )


def test_the_reread_scores_a_sliding_layers_tokens_past_its_window(monkeypatch):
    # the queries repeating the last tokens a sliding layer holds sit a whole context later,
    # outside its window: the reconstruction statistics see past it, attention itself does not
    from kvstack.cache import statistics
    from tiny import tiny_gemma3

    model = tiny_gemma3()
    seen: list[tuple[int, int, int | None]] = []
    record = statistics.record

    def spy(layer, needs, query, query_slots, padding, window, scale):
        seen.append((layer.layer_idx, query.shape[2], window))
        return record(layer, needs, query, query_slots, padding, window, scale)

    monkeypatch.setattr(statistics, "record", spy)
    model._kvstack_repeat_ids = ([5, 6, 7], [8])
    cache = KVCache(model, "kvzip", 0.5)
    Runner(model, cache).forward(torch.randint(3, 90, (1, 60)), torch.ones(1, 60, dtype=torch.long))
    reread = [(i, w) for i, q, w in seen if q == 63]  # "repeat" + the 60 tokens
    assert {i for i, _ in reread} == set(range(6)) and all(w is None for _, w in reread)
    seen.clear()
    Runner(model, KVCache(model, "h2o", 0.5)).forward(
        torch.randint(3, 90, (1, 60)), torch.ones(1, 60, dtype=torch.long)
    )
    assert [w for _, _, w in seen] == [16, 16, 16, 16, 16, None]  # other statistics keep the window
