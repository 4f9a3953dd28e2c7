"""Piecewise encoding between added tokens: the same ids as encoding whole, pieces remembered."""

from __future__ import annotations

import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopstack.engine.text.segment_cache import SegmentCache
from loopstack.engine.text.tokenizer import Tokenizer

from .test_spm_tokenizer import spm_metadata
from .test_tokenizer import SMOLLM2_TEXT

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>"]
# texts with added tokens anywhere in them, whitespace and digits against their edges
PIECES = st.lists(st.one_of(SMOLLM2_TEXT, st.sampled_from(SPECIALS), st.sampled_from([" ", "\n", "  \n", "12"])),
                  max_size=12).map("".join)


def whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=PIECES)
def test_pieces_give_the_ids_of_the_whole_text(default_model, text):
    tokenizer = default_model.tokenizer
    assert tokenizer.segments is not None  # SmolLM2's byte-level BPE qualifies
    assert tokenizer.encode(text) == whole(tokenizer, text)
    assert tokenizer.encode(text) == whole(tokenizer, text)  # again, from kept pieces


def test_a_new_turn_encodes_only_its_new_message(default_model):
    tokenizer = default_model.tokenizer
    cache = SegmentCache.for_backend(tokenizer.backend)
    assert cache is not None
    messages = [{"role": "system", "content": "You are a careful coding agent. " * 8},
                {"role": "user", "content": "Read setup.py and tell me what it installs, then fix the tests."}]
    first = tokenizer.apply_chat_template(messages)
    assert cache.encode(first) == whole(tokenizer, first)
    misses = cache.misses
    messages += [{"role": "assistant", "content": "It installs the package and its two extras; running pytest."},
                 {"role": "user", "content": "Good. Now run the failing test again with -x and show me the output."}]
    second = tokenizer.apply_chat_template(messages)
    assert cache.encode(second) == whole(tokenizer, second)
    # the system and first user messages came from memory; only the two new messages were encoded
    assert cache.misses - misses == 2
    assert cache.hits >= 2


def test_pieces_are_kept_up_to_a_size_least_recently_used_first(default_model):
    tokenizer = default_model.tokenizer
    cache = SegmentCache(tokenizer.backend, {"<|im_end|>": 2}, max_chars=300, min_chars=10)
    texts = [f"message number {i}: " + "words and more words " * 5 for i in range(4)]  # ~120 characters each
    for text in texts:
        assert cache.encode(text + "<|im_end|>") == whole(tokenizer, text) + [2]
    assert len(cache) == 2  # the first two gave their room up
    assert cache.encode(texts[3]) == whole(tokenizer, texts[3]) and cache.hits == 1
    huge = "a long tool output line\n" * 20  # over max_chars: encoded, not kept
    assert cache.encode(huge) == whole(tokenizer, huge) and len(cache) == 2


def test_short_pieces_are_encoded_each_time(default_model):
    cache = SegmentCache.for_backend(default_model.tokenizer.backend)
    assert cache is not None
    cache.encode("<|im_start|>user\nHi<|im_end|>")
    assert len(cache) == 0 and cache.misses == 0


def test_position_dependent_tokenizers_encode_whole():
    # SentencePiece-style backends prefix the text's start with a space marker: pieces would differ
    metadata = spm_metadata({"a": -1.0, "\u2581": -2.0, "\u2581a": -3.0}, **{"tokenizer.ggml.add_space_prefix": True})
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.segments is None
    assert tokenizer.encode("a a") == whole(tokenizer, "a a")


def test_threads_share_one_cache(default_model):
    tokenizer = default_model.tokenizer
    texts = [f"<|im_start|>user\nthread text {i} " + "with enough words to be kept " * 4 + "<|im_end|>" for i in range(40)]
    expected = [whole(tokenizer, t) for t in texts]
    failures: list[int] = []

    def run(offset: int) -> None:
        for i in range(200):
            k = (i * 7 + offset) % len(texts)
            if tokenizer.encode(texts[k]) != expected[k]:
                failures.append(k)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
