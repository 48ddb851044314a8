"""The prefix store: a context compressed once is loaded for the next request (same answers),
least recently used files go past the size limit, and readers never see half a file."""

import threading

import pytest

from kvstack import PrefixStore, answer, answer_cached, compress, load
from kvstack.errors import UserError

CONTEXTS = ["The key is 4711. " * 6, "Blue whales sing at dawn. " * 5, "Seven ships left the bay. " * 5]
SPEC = "snapkv(window_size=4, every=4)"


@pytest.fixture(scope="module")
def lm(tiny_folder):
    return load(str(tiny_folder))


def test_a_stored_context_answers_like_a_fresh_one(lm, tmp_path):
    store = PrefixStore(tmp_path, "10MB")
    expected = answer(lm, [CONTEXTS[0]], ["key?"], SPEC, 0.5, query_agnostic=True, max_new_tokens=6)
    first, hit_first = store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)
    second, hit_second = store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)
    assert (hit_first, hit_second) == (False, True) and (store.hits, store.misses) == (1, 1)
    for cache in (first, second):
        got = answer_cached(lm, cache, ["key?"], max_new_tokens=6)
        assert got.new_tokens == expected.new_tokens and got.kv_bytes == expected.kv_bytes
    assert store.cache_for(lm, CONTEXTS[0], SPEC, 0.25)[1] is False  # another budget is another entry
    assert store.cache_for(lm, CONTEXTS[1], SPEC, 0.5)[1] is False  # another text too


def test_least_recently_used_files_go_first(lm, tmp_path):
    sizes = []
    for context in CONTEXTS:
        cache = compress(lm, context, SPEC, 0.5)
        sizes.append(len(PrefixStore(tmp_path / "probe", "1GB").put(cache, [len(sizes)]).read_bytes()))
    store = PrefixStore(tmp_path / "lru", sum(sizes[:2]) + 1)  # room for two of the three
    store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)
    store.cache_for(lm, CONTEXTS[1], SPEC, 0.5)
    assert store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)[1]  # used again: now the most recent
    store.cache_for(lm, CONTEXTS[2], SPEC, 0.5)  # over the limit: CONTEXTS[1] goes
    assert len(store.files()) == 2 and store.nbytes() <= store.max_bytes
    assert store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)[1]
    assert store.cache_for(lm, CONTEXTS[2], SPEC, 0.5)[1]
    assert not store.cache_for(lm, CONTEXTS[1], SPEC, 0.5)[1]


def test_a_damaged_file_is_a_miss_and_is_dropped(lm, tmp_path):
    store = PrefixStore(tmp_path, "10MB")
    store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)
    (path,) = store.files()
    path.write_bytes(path.read_bytes()[:-7])
    assert store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)[1] is False
    assert store.cache_for(lm, CONTEXTS[0], SPEC, 0.5)[1] is True


def test_readers_see_whole_files_while_a_writer_replaces_and_evicts(lm, tmp_path):
    store = PrefixStore(tmp_path, "10MB")
    cache = compress(lm, CONTEXTS[0], SPEC, 0.5)
    ids = [1, 2, 3]
    store.put(cache, ids)
    expected = cache.nbytes()
    stop, seen, errors = threading.Event(), [], []

    def write() -> None:
        try:
            for _ in range(15):
                store.put(cache, ids)  # rewritten in place under the same name
                store.path(lm.model, SPEC, 0.5, ids).unlink(missing_ok=True)  # and evicted
            store.put(cache, ids)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        finally:
            stop.set()  # the readers stop even if the writer failed

    def read() -> None:
        reader = PrefixStore(tmp_path, "10MB")
        while not stop.is_set():
            try:
                got = reader.get(lm.model, SPEC, 0.5, ids)
            except Exception as e:  # noqa: BLE001 (any error is a failure to report)
                errors.append(e)
                return
            if got is not None:
                seen.append(got.nbytes())

    threads = [
        threading.Thread(target=write, daemon=True),
        *(threading.Thread(target=read, daemon=True) for _ in range(2)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)  # a hang fails the test instead of the whole run
    assert not any(t.is_alive() for t in threads)
    assert not errors and seen and set(seen) == {expected}


def test_a_store_needs_a_size(tmp_path):
    with pytest.raises(UserError, match="positive size"):
        PrefixStore(tmp_path, "0.5")
