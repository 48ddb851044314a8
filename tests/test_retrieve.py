"""Retrieval (`quest`): the slow tier on disk, its page index, page ranking, and the cache that
attends resident tokens plus the pages brought back."""

import gc
import math
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ids_of
from kvstack.cache.cache import KVCache
from kvstack.cache.layer import storage_bytes
from kvstack.cache.stores import HostStore
from kvstack.cache.tier import EMPTY_SLOT, NO_PAGE, Tier
from kvstack.errors import UserError
from kvstack.generate import Runner
from kvstack.methods.retrieve.base import resident_share, top_entries
from kvstack.methods.retrieve.hisa import Hisa
from kvstack.methods.retrieve.louiskv import LouisKV
from kvstack.methods.retrieve.lycheedecode import LycheeDecode, retrieval_heads
from kvstack.methods.retrieve.quest import Quest
from kvstack.methods.retrieve.s3 import S3, bm25, last_words, reciprocal_rank
from kvstack.methods.retrieve.shadowselect import ShadowSelect, outlier_chunks
from kvstack.methods.retrieve.squeezed import Squeezed, kmeans
from kvstack.methods.retrieve.tokenselect import soft_votes
from kvstack.policy import policy as policy_module
from kvstack.stack import Stack
from test_cache import prompt, step_logits


def _tier(keys: torch.Tensor, page: int) -> Tier:
    """A tier of one sequence and head holding keys (t, d) (values = -keys) at slots 10, 11, ..."""
    t, d = keys.shape
    tier = Tier(1, 1, d, keys.dtype, page)
    slots = torch.arange(10, 10 + t)[None, None]
    tier.append(keys[None, None], -keys[None, None], slots, torch.ones(1, 1, t, dtype=torch.bool))
    return tier


def test_page_index_by_hand():
    keys = torch.tensor([[1.0, -2.0], [3.0, 0.0], [-1.0, 5.0], [2.0, 2.0], [0.0, -4.0]])
    tier = _tier(keys, page=2)
    assert tier.count.tolist() == [[5]] and tier.pages.tolist() == [[3]]
    assert tier.index["lo"][0, 0].tolist() == [[1.0, -2.0], [-1.0, 2.0], [0.0, -4.0]]
    assert tier.index["hi"][0, 0].tolist() == [[3.0, 0.0], [2.0, 5.0], [0.0, -4.0]]
    # a second append fills the last page first, and its summary takes the new key in
    more = torch.tensor([[-3.0, 1.0]])
    tier.append(more[None, None], -more[None, None], torch.tensor([[[20]]]), torch.ones(1, 1, 1, dtype=torch.bool))
    assert tier.pages.tolist() == [[3]]
    assert tier.index["lo"][0, 0, 2].tolist() == [-3.0, -4.0] and tier.index["hi"][0, 0, 2].tolist() == [0.0, 1.0]


def test_fetch_reads_back_what_was_written_and_marks_empty_entries():
    keys = torch.arange(10.0).reshape(5, 2).to(torch.bfloat16)
    tier = _tier(keys, page=2)
    got = tier.fetch(torch.tensor([[[2, 0, 7]]]))  # page 2 in part, page 0 whole, page 7 never written
    assert got.slots.tolist() == [[[14, EMPTY_SLOT, 10, 11, EMPTY_SLOT, EMPTY_SLOT]]]
    assert torch.equal(got.keys[0, 0, 0], keys[4]) and torch.equal(got.keys[0, 0, 2:4], keys[:2])
    assert torch.equal(got.values[0, 0, 2:4], -keys[:2])
    last = os.fstat(tier.store.file.fileno()).st_size - 2 * tier.record_bytes  # the file ends inside page 2
    assert got.nbytes == tier.record_bytes + last  # pages 0 and 2 read, the unwritten one skipped
    assert tier.offloaded_nbytes() == 5 * (2 * 2 * 2 + 4)


def test_an_eight_bit_tier_stores_half_and_reads_back_within_a_code_step():
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 2, 40, 16, generator=gen), torch.randn(1, 2, 40, 16, generator=gen)
    slots, moved = torch.arange(40).expand(1, 2, 40), torch.ones(1, 2, 40, dtype=torch.bool)
    wide, narrow = Tier(1, 2, 16, torch.float32, 8), Tier(1, 2, 16, torch.float32, 8, bits=8)
    for tier in (wide, narrow):
        tier.append(keys, values, slots, moved)
    assert narrow.offloaded_nbytes() == 80 * (16 + 16 + 2 + 2 + 4)  # codes, scales, slot
    assert wide.offloaded_nbytes() == 80 * (4 * 16 * 2 + 4)
    got = narrow.fetch(torch.tensor([[[0, 4], [1, 2]]]))
    assert got.slots[0, 0].tolist() == [*range(8), *range(32, 40)]
    step = keys[0, 0, :8].abs().amax(-1, keepdim=True) / 127  # each token's scale
    assert bool(((got.keys[0, 0, :8] - keys[0, 0, :8]).abs() <= step / 2 + 1e-3).all())
    torch.testing.assert_close(narrow.index["lo"], wide.index["lo"])  # summaries come from the exact keys


def test_quest_bound_by_hand_and_selection_equals_exact_top_pages():
    lo = torch.tensor([[[[1.0, -2.0], [0.0, 0.0]]]])
    hi = torch.tensor([[[[3.0, 1.0], [2.0, 4.0]]]])
    q = torch.tensor([[[[1.0, -1.0]]]])  # bound: max(1*1, 1*3) + max(-1*-2, -1*1) = 3 + 2; then 2 + 0
    assert Quest().rank(q, {"lo": lo, "hi": hi}).tolist() == [[[5.0, 2.0]]]
    # pages of identical keys: the bound is the exact largest logit, so the top pages are exact
    gen = torch.Generator().manual_seed(0)
    per_page = torch.randn(12, 8, generator=gen)
    keys = per_page.repeat_interleave(4, dim=0)  # (48, 8), page = 4 tokens of one key
    tier = _tier(keys, page=4)
    query = torch.randn(1, 1, 3, 8, generator=gen)  # 3 query heads of the group share a selection
    ranks = Quest().rank(query, tier.index)
    exact = (query[0, 0] @ keys.T).amax(0).view(12, 4).amax(-1)
    assert set(ranks[0, 0].topk(3).indices.tolist()) == set(exact.topk(3).indices.tolist())


def test_kmeans_finds_planted_clusters_and_squeezed_pages_hold_one_each():
    gen = torch.Generator().manual_seed(1)
    centres = torch.tensor([[8.0, 0.0, 0.0], [0.0, 8.0, 0.0], [0.0, 0.0, 8.0]])
    truth = torch.arange(24) % 3  # the clusters interleaved along the sequence
    keys = centres[truth] + 0.3 * torch.randn(24, 3, generator=gen)
    labels = kmeans(keys, 3, 8)
    assert all(len(set(labels[truth == c].tolist())) == 1 for c in range(3)) and len(set(labels.tolist())) == 3
    method = Squeezed(page=8, select=8)
    moved = torch.ones(1, 1, 24, dtype=torch.bool)
    tier = Tier(1, 1, 3, torch.float32, 8, summaries=method.summaries)
    order = method.arrange(keys[None, None], moved)
    tier.append(keys[None, None], keys[None, None], torch.arange(24)[None, None], moved, order)
    got = tier.fetch(torch.tensor([[[0, 1, 2]]]))
    pages = truth[got.slots.view(3, 8)]  # each page of the tier holds one planted cluster
    assert all(len(set(row.tolist())) == 1 for row in pages)
    query = torch.tensor([[[[0.0, 1.0, 0.0]]]])  # matches the second centre: its page ranks first
    best = int(method.rank(query, tier.index)[0, 0].argmax())
    assert set(truth[got.slots[0, 0, best * 8 : (best + 1) * 8]].tolist()) == {1}
    torch.testing.assert_close(tier.index["mean"][0, 0, best], keys[truth == 1].mean(0))


def test_bm25_by_hand():
    words = torch.tensor([[[[5, 6, 7], [8, 9, -1]]]])  # page 0: three words, page 1: two
    # "9" twice counts once; "3" is in no page. N = 2 pages, df(9) = 1: idf = ln(1 + 1.5 / 1.5);
    # page 1 is 2 words against 2.5 on average: tf 1 -> 2.2 / (1 + 1.2 (0.25 + 0.75 * 2 / 2.5))
    got = bm25(words, torch.tensor([[9, 9, 3]]), 1.2, 0.75)
    assert got[0, 0, 0] == 0 and abs(float(got[0, 0, 1]) - math.log(2) * 2.2 / 2.02) < 1e-6
    # the query is each row's last known words: padding (-1) between context and question is skipped
    assert last_words(torch.tensor([[4, 5, -1, -1, 6], [-1, -1, -1, -1, 7]]), 3).tolist() == [[6, 5, 4], [7, -1, -1]]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 12), st.integers(1, 10))
def test_bm25_equals_its_definition_word_by_word(seed, pages, width):
    """The vectorised BM25 against the formula written out per page and distinct query word."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-1, 15, (1, 2, pages, 6), generator=gen)
    query = torch.randint(-1, 15, (1, width), generator=gen)
    got = bm25(words, query, 1.2, 0.75)
    for h in range(2):
        docs = [[w for w in page.tolist() if w >= 0] for page in words[0, h]]
        held = [d for d in docs if d]
        avg = sum(map(len, held)) / max(len(held), 1)
        for p, doc in enumerate(docs):
            want = 0.0
            for word in {w for w in query[0].tolist() if w >= 0}:
                tf, df = doc.count(word), sum(word in d for d in held)
                idf = math.log(1 + (len(held) - df + 0.5) / (df + 0.5))
                want += idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * len(doc) / max(avg, 1)))
            assert float(got[0, h, p]) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_s3_brings_back_the_page_that_names_what_the_text_asks_and_the_page_after():
    ids = torch.arange(100, 140)  # 40 tokens, each its own word; slot s holds word 100 + s
    ids[[3, 13, 23, 33]] = 7  # a common word on every page: it tells no page apart
    tier = Tier(1, 1, 2, torch.float32, 10, summaries=("slots", "lo", "hi"))
    keys = torch.zeros(1, 1, 40, 2)
    tier.append(keys, keys, torch.arange(40)[None, None], torch.ones(1, 1, 40, dtype=torch.bool))
    text = torch.cat([ids, torch.tensor([7, 125, 99])])[None]  # the question names word 125 (page 2)
    ranks = S3(page=10, select=20, window=3).rank(torch.zeros(1, 1, 1, 2), tier.index, text)[0, 0]
    common = math.log1p(0.5 / 4.5) * 2.2 / (1 + 1.2)  # "7", once on each of 4 pages of 10 words
    assert ranks[:2].tolist() == pytest.approx([common, common])  # on every page: it tells none apart
    assert ranks[2] > 3 * common and ranks[3] == ranks[2]  # the page naming 125, and the page after
    assert S3(page=10, select=20).choose(ranks[None, None], 1).tolist() == [[[2]]]  # a tie: the earlier page
    # fused with Quest's bound by reciprocal rank: page 0 first by keys, page 2 first by text
    tier.index["hi"][0, 0, 0] = 1.0
    fused = S3(page=10, select=20, window=3, fuse=True).rank(torch.ones(1, 1, 1, 2), tier.index, text)[0, 0]
    lexical = [1 / 63, 1 / 63, 1 / 61, 1 / 61]  # pages 2 and 3 tie first, 0 and 1 third
    attention = [1 / 61, 1 / 62, 1 / 62, 1 / 62]  # page 0 first, the rest tie second
    assert fused.tolist() == pytest.approx([a + b for a, b in zip(lexical, attention, strict=True)])
    assert reciprocal_rank(torch.tensor([3.0, 1.0, 3.0])).tolist() == pytest.approx([1 / 61, 1 / 63, 1 / 61])
    with pytest.raises(UserError, match="kvstack's own loop"):
        S3().rank(torch.zeros(1, 1, 1, 2), tier.index, None)


def test_hisa_attends_exactly_the_top_tokens_and_tokenselect_votes_by_softmax():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(48, 8, generator=gen)
    tier = Tier(1, 1, 8, torch.float32, 4, summaries=Hisa.summaries)
    tier.append(
        keys[None, None], keys[None, None], torch.arange(48)[None, None], torch.ones(1, 1, 48, dtype=torch.bool)
    )
    query = torch.randn(1, 1, 3, 8, generator=gen)  # a group of 3 query heads, one selection
    got = tier.fetch(Hisa(page=4, select=48).choose(Hisa(page=4, select=48).rank(query, tier.index), 12))
    chosen = Hisa(page=4, select=48, tokens=5).refine(query, got.keys, got.slots >= 0)
    exact = (query[0, 0] @ keys.T).amax(0).topk(5).indices  # exact top-5 of q . k over every token
    assert set(got.slots[chosen].tolist()) == set(exact.tolist())
    # soft voting by hand: head A peaks on entry 0, head B is flat; raw logits would pick entry 2
    q = torch.tensor([[[[4.0, 0.0], [0.0, 1.0]]]])  # (b, h, 2 query heads, d = 2)
    k = torch.tensor([[[[2.0, 0.0], [0.0, 0.0], [0.0, 9.0]]]])
    votes = soft_votes(q, k, torch.ones(1, 1, 3, dtype=torch.bool))[0, 0]
    a = torch.softmax(torch.tensor([8.0, 0.0, 0.0]) / math.sqrt(2), 0)
    b = torch.softmax(torch.tensor([0.0, 0.0, 9.0]) / math.sqrt(2), 0)
    torch.testing.assert_close(votes, a + b)
    assert top_entries(votes, torch.tensor([[[True, True, False]]]), 1).tolist() == [[[True, False, False]]]


def test_s3_records_the_token_ids_and_counts_them_as_resident(llama):
    ids = torch.tensor([prompt(60)])
    s3, quest = KVCache(llama, "s3(page=4, select=16)", 0.3), KVCache(llama, "quest(page=4, select=16)", 0.3)
    for cache in (s3, quest):
        Runner(llama, cache).forward(ids, torch.ones_like(ids))
    assert s3.seq.ids.tolist() == ids.tolist() and quest.seq.ids is None
    held = storage_bytes([t for layer in s3.layers for t in layer.tensors()]) + s3.working_nbytes
    assert s3.nbytes() == held + 60 * 4  # an int32 id per slot, once for every layer


def test_quest_brings_back_the_pages_after_its_best_ones_once_each():
    ranks = torch.tensor([[[0.0, 5.0, 1.0, 4.0, 2.0, 3.0]]])
    assert Quest().choose(ranks, 4).tolist() == [[[1, 3, 4, 5]]]  # the 4 best
    assert Quest(neighbors=1).choose(ranks, 4).tolist() == [[[1, 2, 3, 4]]]  # 1 and 3, each with the next
    touching = torch.tensor([[[0.0, 5.0, 4.0, 0.0, 0.0, 0.0]]])  # 2 is best and next to 1: asked once
    assert Quest(neighbors=1).choose(touching, 4).tolist() == [[[1, 2, 3, 6]]]  # 6: no page
    tier = _tier(torch.arange(12.0).reshape(6, 2), page=2)
    got = tier.fetch(Quest(neighbors=1).choose(touching[..., :3], 2))  # pages 1, 2 of a 3-page tier
    assert got.slots.tolist() == [[[12, 13, 14, 15]]]


def test_resident_share_by_hand():
    # keep 100 tokens of 20 bytes; 640 tokens may leave: 40 pages of 16, index 10 bytes per page
    # -> 20 tokens + 1; 79 left, half of it (39) for fetched pages over 4 layers: 156 tokens,
    # capped by select 64 -> 4 pages, 16 tokens per layer
    keep, pages = resident_share(torch.tensor([[100, 100]]), torch.tensor([640]), 16, 64, 20, 10, 4)
    assert pages.tolist() == [4] and keep.tolist() == [[63, 63]]
    keep, pages = resident_share(torch.tensor([[30]]), torch.tensor([640]), 16, 64, 20, 10, 4)
    assert pages.tolist() == [1] and keep.tolist() == [[5]]  # 9 left: 4 x 4 layers = one page, 4 tokens per layer
    keep, pages = resident_share(torch.tensor([[25]]), torch.tensor([640]), 16, 64, 20, 10, 4)
    assert pages.tolist() == [0] and keep.tolist() == [[4]]  # too little left to fetch a page: streaming alone
    # in a batch each row shares on its own: the three cases above, side by side
    keep, pages = resident_share(torch.tensor([[100], [30], [25]]), torch.tensor([640] * 3), 16, 64, 20, 10, 4)
    assert pages.tolist() == [4, 1, 0] and keep.tolist() == [[63], [5], [4]]


@pytest.mark.parametrize(
    "spec",
    [
        "quest(page=4)",
        "squeezed(page=4)",
        "s3(page=4)",
        "s3(page=4, fuse=True)",
        "hisa(page=4, tokens=4096)",
        "tokenselect(page=4, tokens=4096)",
        "louiskv(page=4)",
        "lycheedecode(page=4)",
        "shadowselect(page=4)",
    ],
)
def test_retrieving_every_page_gives_the_full_cache(llama, monkeypatch, spec):
    """With every page of the tier brought back, attention sees every token: the full cache's logits."""
    share = policy_module.resident_share
    monkeypatch.setattr(policy_module, "resident_share", lambda *a: (share(*a)[0], torch.full_like(a[1], 10**6)))
    ctx = [prompt(90), prompt(70, seed=3)]
    width = max(map(len, ctx))
    ids = torch.tensor([[0] * (width - len(c)) + c for c in ctx])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in ctx])
    full, quest = Runner(llama, KVCache(llama, "full", 1.0)), Runner(llama, KVCache(llama, spec, 0.25))
    full.forward(ids, mask)
    quest.forward(ids, mask)
    assert all(layer.tier is not None and int(layer.tier.count.min()) > 0 for layer in quest.cache.layers)
    for step in prompt(6, seed=5):
        nxt = torch.tensor([[step], [step]])
        a, b = full.forward(nxt, torch.ones_like(nxt)), quest.forward(nxt, torch.ones_like(nxt))
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    chunk = torch.tensor([prompt(21, seed=9)] * 2)  # a question: three blocks of queries, each its own pages
    a, b = full.forward(chunk, torch.ones_like(chunk)), quest.forward(chunk, torch.ones_like(chunk))
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_resident_bytes_within_budget_at_every_step_of_a_long_generation(llama):
    cache = KVCache(llama, "quest(page=8, select=64)", 0.25)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(200)]), torch.ones(1, 200, dtype=torch.long))
    assert cache.nbytes() <= 0.25 * cache.full_nbytes()
    fetched = 0
    for t in prompt(512, seed=7):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
        assert cache.nbytes() <= 0.25 * cache.full_nbytes()
        fetched = cache.fetched_nbytes
    assert fetched > 0 and cache.working_nbytes > 0  # pages really came back while decoding
    assert cache.offloaded_nbytes() > 2 * cache.nbytes()  # most tokens live in the slow tier
    held = sum(int(layer.counts().sum()) + int(layer.tier.count.sum()) for layer in cache.layers)
    assert held == len(cache.layers) * llama.config.num_key_value_heads * 712  # nothing was dropped


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_the_slow_tier_leaves_memory():
    tier = Tier(1, 4, 128, torch.bfloat16, 16)
    gc.collect()
    before = _rss()
    chunk = 8192
    for start in range(0, 160 * 1024, chunk):  # 160k tokens x 4 heads x 516 bytes: 338 MB to the file
        kv = torch.randn(1, 4, chunk, 128, dtype=torch.bfloat16)
        slots = torch.arange(start, start + chunk).expand(1, 4, chunk)
        tier.append(kv, kv, slots, torch.ones(1, 4, chunk, dtype=torch.bool))
        del kv
    gc.collect()
    grown = _rss() - before
    assert tier.offloaded_nbytes() > 300e6
    index = sum(t.nbytes for t in tier.tensors())  # 1/16 of the keys, twice: ~21 MB
    assert grown < index + 60e6, f"RSS grew {grown / 1e6:.0f} MB for {tier.offloaded_nbytes() / 1e6:.0f} MB offloaded"
    got = tier.fetch(torch.tensor([[[0, 9999]]] * 4).view(1, 4, 2))
    assert got.slots[0, 2].tolist()[:2] == [0, 1] and got.slots[0, 0, 16] == 9999 * 16


def test_agnostic_questions_work_and_batches_equal_single_rows(llama):
    rows = [(prompt(120), prompt(10, seed=4)), (prompt(90, seed=2), prompt(7, seed=6))]
    both, measured = ids_of(llama, rows, "quest(page=8, select=32)", 0.3, agnostic=True)
    for row, got in zip(rows, both, strict=True):
        alone, _ = ids_of(llama, [row], "quest(page=8, select=32)", 0.3, agnostic=True)
        assert alone[0] == got


def test_stacks_a_retriever_cannot_join_are_refused():
    with pytest.raises(UserError, match="drop kivi"):
        Stack.parse("quest+kivi")
    with pytest.raises(UserError):
        Stack.parse("quest+snapkv")
    with pytest.raises(UserError, match="scorer must be"):
        Stack.parse("adakv(quest)")
    with pytest.raises(UserError, match="neighbors must be"):
        Stack.parse("quest(neighbors=-1)")
    with pytest.raises(UserError, match="bits must be 16"):
        Stack.parse("quest(bits=4)")
    with pytest.raises(UserError, match="select must be at least one page"):
        Stack.parse("quest(page=32, select=16)")
    assert Stack.parse("quest(kvzip)").retriever is not None


def test_a_tiered_cache_refuses_to_save_in_one_line(llama, tmp_path):
    cache = KVCache(llama, "quest(page=4, select=16)", 0.3)
    Runner(llama, cache).forward(torch.tensor([prompt(80)]), torch.ones(1, 80, dtype=torch.long))
    with pytest.raises(UserError, match="tier"):
        cache.save(tmp_path / "c.safetensors")


def test_generate_reports_the_slow_tier(tiny_folder, tmp_path):
    from test_cli import run

    path = tmp_path / "context.txt"
    path.write_text("The code of the blue door is 4711. " * 30)
    args = ["generate", "--model", str(tiny_folder), "--method", "quest(page=4, select=16)", "--budget", "0.3"]
    code, out, err = run(*args, "-c", str(path), "-q", "What is the code?")
    assert code == 0, err
    line = " ".join(out.split())  # the terminal may wrap the summary
    assert re.search(r"ratio 0\.2\d\d, .*slow tier [\d.]+ MiB on disk, \d+ KiB read back per token", line), line


def test_louiskv_ranks_afresh_only_when_the_query_turns_away():
    method = LouisKV(page=4, select=8, threshold=0.9)
    anchor = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (1, 2 heads, d 2)
    near = torch.tensor([[[[1.0, 0.2], [1.0, 0.2]], [[1.0, 0.0], [-1.0, 0.0]]]])  # head 1's queries average to 0
    assert method.stale(near, anchor).tolist() == [[False, True]]  # cos 0.98 keeps; a turned mean ranks
    assert LouisKV(page=4, select=8, threshold=-1.0).stale(near, anchor).tolist() == [[False, False]]


def test_louiskv_clusters_the_prompt_and_keeps_the_output_in_order_after_it():
    centres = torch.tensor([[8.0, 0.0], [0.0, 8.0]])
    truth = torch.arange(16) % 2
    keys = (centres[truth] + 0.1 * torch.randn(16, 2, generator=torch.Generator().manual_seed(0)))[None, None]
    moved = torch.ones(1, 1, 16, dtype=torch.bool)
    prompt = (torch.arange(16) < 12)[None, None]  # the last 4 tokens were generated
    order = LouisKV(page=6, select=6).arrange(keys, moved, prompt)[0, 0]
    assert len(set(order[:12][truth[:12] == 0].tolist())) == 1 and len(set(order[:12].tolist())) == 2
    assert order[12:].tolist() == [2] * 4  # one segment after both clusters (slot order within it)
    tier = Tier(1, 1, 2, torch.float32, 6, summaries=("mean",))
    tier.append(keys, keys, torch.arange(16)[None, None], moved, order[None, None])
    assert tier.fetch(torch.tensor([[[2]]])).slots[0, 0, :4].tolist() == [12, 13, 14, 15]


def test_louiskv_keeps_its_choice_while_the_query_stays_and_counts_what_it_remembers(llama, monkeypatch):
    calls = []
    rank = LouisKV.rank
    monkeypatch.setattr(LouisKV, "rank", lambda self, *a: calls.append(1) or rank(self, *a))
    counts = {}
    for threshold in (-1.0, 1.0):
        calls.clear()
        cache = KVCache(llama, f"louiskv(page=4, select=16, threshold={threshold})", 0.3)
        runner = Runner(llama, cache)
        runner.forward(torch.tensor([prompt(120)]), torch.ones(1, 120, dtype=torch.long))
        before = len(calls)
        chosen = []
        for t in prompt(12, seed=2):
            runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
            chosen.append(cache.layers[1].tier.chosen.clone())
            assert cache.nbytes() <= 0.3 * cache.full_nbytes()
        counts[threshold] = len(calls) - before
        layer = cache.layers[1]
        remembered = layer.tier.anchor.nbytes + layer.tier.chosen.nbytes
        assert 0 < remembered < layer.token_bytes() * layer.tier.heads  # under one token per head (paid for)
    steps, layers = 12, len(cache.layers)
    assert counts[1.0] == steps * layers  # every step ranks
    assert counts[-1.0] < steps * layers // 2  # a query that never turns: ranks only when the pages grow


def test_lycheedecode_followers_take_the_retrieval_heads_ranking():
    ranks = torch.tensor([[[1.0, 2.0, 3.0], [3.0, 1.0, 2.0], [2.0, 3.0, 1.0]]])  # (1, 3 heads, 3 pages)
    table = torch.tensor([[0.1, 0.7, 0.2]])  # layer 0: head 1 retrieves most
    led = LycheeDecode(page=4, select=8).lead(ranks, table, 0)
    assert led[0].tolist() == [[3.0, 1.0, 2.0]] * 3
    two = LycheeDecode(page=4, select=8, leaders=2).lead(ranks, table, 0)
    assert two[0, 1:].tolist() == ranks[0, 1:].tolist()  # the leaders keep their own
    fused = 1 / torch.tensor([61.0, 63.0, 62.0]) + 1 / torch.tensor([62.0, 61.0, 63.0])  # reciprocal ranks by hand
    torch.testing.assert_close(two[0, 0], fused)
    assert retrieval_heads(torch.tensor([0.2, 0.5, 0.5]), 1).tolist() == [1]  # ties to the lower head


def test_lycheedecode_brings_back_the_leaders_pages_for_every_head(llama, monkeypatch):
    fetched = []
    fetch = Tier.fetch
    monkeypatch.setattr(Tier, "fetch", lambda self, pages: fetched.append(pages.clone()) or fetch(self, pages))
    cache = KVCache(llama, "lycheedecode(page=4, select=16)", 0.3)
    runner = Runner(llama, cache)
    runner.forward(torch.tensor([prompt(120)]), torch.ones(1, 120, dtype=torch.long))
    for t in prompt(4, seed=2):
        runner.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.long))
    assert fetched and all(bool((pages == pages[:, :1]).all()) for pages in fetched)  # one choice per layer
    with pytest.raises(UserError, match="build the KVCache from the model"):
        LycheeDecode().load(llama.config)


def test_shadowselect_outliers_and_landmark_softmax_by_hand():
    keys = torch.ones(1, 1, 20, 2)
    keys[0, 0, 9] = torch.tensor([1.0, -1.0])  # chunk 1 (positions 8-15) holds one key unlike the rest
    keys[0, 0, 17] = torch.tensor([-1.0, 0.0])  # chunk 2 is not held whole (positions 16-19)
    positions = torch.arange(20)[None, None]
    valid = torch.ones(1, 1, 20, dtype=torch.bool)
    kept = outlier_chunks(keys, positions, valid, 8, torch.tensor([[1]]))[0, 0]
    assert kept.nonzero().squeeze(-1).tolist() == list(range(8, 16))
    assert not outlier_chunks(keys, positions, valid, 8, torch.tensor([[0]])).any()
    means = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]]])  # the third page is not written yet
    queries = torch.tensor([[[[2.0, 0.0], [0.0, 2.0]]]])
    got = ShadowSelect(page=8, select=8).rank(queries, {"mean": means})
    one = torch.softmax(torch.tensor([2.0, 0.0]) / math.sqrt(2), -1)
    torch.testing.assert_close(got[0, 0], torch.cat([one + one.flip(0), torch.zeros(1)]))


def test_shadowselect_keeps_its_outlier_chunks_resident(llama):
    cache = KVCache(llama, "shadowselect(page=4, select=16, outliers=2)", 0.6)  # 32 tokens a head stay resident
    Runner(llama, cache).forward(torch.tensor([prompt(120)]), torch.ones(1, 120, dtype=torch.long))
    layer = cache.layers[1]
    slots = layer.dense_slots()[0]  # (h, t) what each head holds
    for h in range(slots.shape[0]):
        held = slots[h][slots[h] >= 0]
        chunks = torch.bincount(held // 8, minlength=16)
        whole = (chunks[:11] == 8).sum()  # chunks held whole below the recent window (91-119)
        assert whole >= 2, f"head {h} holds {int(whole)} whole chunks"


def test_a_host_memory_tier_reads_back_what_a_file_tier_does():
    gen = torch.Generator().manual_seed(3)
    tiers = {kind: Tier(2, 2, 8, torch.bfloat16, 4, store=kind) for kind in ("disk", "host")}
    for step in range(3):  # appends of uneven lengths per head, over several pages
        t = 7 + 5 * step
        keys = torch.randn(2, 2, t, 8, generator=gen).to(torch.bfloat16)
        slots = torch.arange(100 * step, 100 * step + t).expand(2, 2, t)
        moved = torch.rand(2, 2, t, generator=gen) < 0.7
        for tier in tiers.values():
            tier.append(keys, -keys, slots, moved)
    pages = torch.tensor([[[0, 2, 5], [1, 3, 9]], [[4, 0, 1], [2, 2, NO_PAGE]]])  # 9: past every head's pages
    disk, host = tiers["disk"], tiers["host"]
    assert isinstance(host.store, HostStore) and not host.store.pinned  # pinned only where CUDA is
    for a, b in [
        (disk, host),
        (disk.copy(), host.copy()),
        (disk.select_batch(torch.tensor([1])), host.select_batch(torch.tensor([1]))),
    ]:
        rows = pages[: a.batch]
        got, want = b.fetch(rows), a.fetch(rows)
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert torch.equal(got.slots, want.slots) and got.nbytes == want.nbytes
        assert bool((got.slots[:, 1, -4:] == EMPTY_SLOT).all())  # page 9 and NO_PAGE bring back nothing
    store = HostStore()
    store.write(b"abcdef", (1 << 20) - 2)  # grows past its first megabyte
    first, second = bytearray(3), bytearray(5)
    assert store.readv([memoryview(first), memoryview(second)], (1 << 20) - 2) == 6  # short past the end
    assert bytes(first) == b"abc" and bytes(second[:3]) == b"def"


def test_a_retriever_on_a_host_tier_answers_as_on_disk(llama):
    runs = {}
    for kind in ("disk", "host"):
        cache = KVCache(llama, f"quest(page=4, select=16, store={kind})", 0.3)
        logits = step_logits(llama, cache, prompt(90), prompt(6, seed=4))
        runs[kind] = (logits, cache.nbytes(), cache.offloaded_nbytes())
    assert torch.equal(runs["disk"][0], runs["host"][0]) and runs["disk"][1:] == runs["host"][1:]
    with pytest.raises(UserError, match="store must be one of auto, disk, host"):
        Stack.parse("quest(store=gpu)")
