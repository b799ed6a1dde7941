"""N-gram overlap between training texts and evaluation items (`swiftlm eval` contamination)."""

import pytest

import swiftlm.evaluation.contamination as contamination
from swiftlm.errors import ConfigError
from swiftlm.evaluation.contamination import (
    build_index,
    check,
    ngram_hashes,
    normalize,
    scan,
    texts_of_row,
)

ITEM = (
    "A farmer has seventeen sheep and all but nine run away; how many sheep does the farmer "
    "have left at the end of the day?"
)
PARAPHRASE = (
    "Seventeen lambs belong to a shepherd. Every lamb except nine escapes. Count what "
    "remains with that shepherd by nightfall."
)
TRAIN = [
    "The mitochondria is the powerhouse of the cell, as every biology student learns early.",
    "Some filler text about the weather and the price of bread in the old market town.",
    f"Question: {ITEM}\nAnswer: nine",
]
SHORT = "what is the capital city of france today"  # 8 words: checked as one 8-gram
TOO_SHORT = "capital of france"


def test_verbatim_copy_is_flagged_with_ratio_one():
    report = check(build_index(TRAIN), [("q1", ITEM)])
    (item,) = report.items
    assert item.n_used == 13 and item.ngrams == len(normalize(ITEM)) - 12
    assert (item.ratio, item.contaminated, item.too_short) == (1.0, True, False)
    assert (report.checked, report.contaminated, report.share) == (1, 1, 1.0)


def test_paraphrase_with_other_words_is_clean():
    (item,) = check(build_index(TRAIN), [("q1", PARAPHRASE)]).items
    assert (item.matched, item.ratio, item.contaminated) == (0, 0.0, False)


def test_case_punctuation_and_unicode_forms_still_match():
    changed = ITEM.upper().replace(";", " --").replace("?", "!!") + "  "
    changed = changed.replace("A FARMER", "Ａ ＦＡＲＭＥＲ")  # full-width letters: NFKC folds them
    (item,) = check(build_index(TRAIN), [("q1", changed)]).items
    assert item.ratio == 1.0


def test_partial_overlap_ratio_and_threshold():
    words = normalize(ITEM)
    # The first 15 words of the item, then new words: 3 of its n-grams are in training.
    mixed = " ".join(words[:15] + ["zebra", "quokka", "axolotl", "narwhal", "okapi"])
    index = build_index(TRAIN)
    (item,) = check(index, [("m", mixed)]).items
    assert (item.matched, item.ngrams) == (3, 8)
    assert item.contaminated
    (strict,) = check(index, [("m", mixed)], threshold=0.5).items
    assert strict.ratio == pytest.approx(3 / 8) and not strict.contaminated


def test_short_items_use_their_length_down_to_min_n():
    train = TRAIN + [f"Trivia night: {SHORT}? Paris, of course."]
    items = [
        ("short", SHORT),
        ("short_clean", "what is the capital city of peru today"),
        ("tiny", TOO_SHORT),
    ]
    report = check(build_index(train), items)
    short, clean, tiny = report.items
    assert (short.n_used, short.ngrams, short.ratio, short.contaminated) == (8, 1, 1.0, True)
    assert (clean.n_used, clean.contaminated) == (8, False)
    assert (tiny.too_short, tiny.contaminated, tiny.n_used) == (True, False, 0)
    assert report.summary() == {
        "n": 13,
        "min_n": 8,
        "threshold": 0.0,
        "items": 3,
        "checked": 2,
        "contaminated": 1,
        "contaminated_share": 0.5,
        "too_short": 1,
    }


def test_ngrams_do_not_span_two_training_texts():
    words = normalize(ITEM)  # 25 words: 13 13-grams
    split = [" ".join(words[:12]), " ".join(words[12:])]
    (item,) = check(build_index(split), [("q", ITEM)]).items
    # Only the one 13-gram inside the second text matches, none across the boundary.
    assert (item.matched, item.ngrams) == (1, 13)


def test_scan_gives_the_same_report_as_the_index():
    train = TRAIN + [f"Trivia night: {SHORT}? Paris, of course."]
    items = [("a", ITEM), ("b", PARAPHRASE), ("c", SHORT), ("d", TOO_SHORT), ("e", ITEM[:60])]
    assert scan(train, items).items == check(build_index(train), items).items


def test_index_compaction_keeps_every_ngram(monkeypatch):
    monkeypatch.setattr(contamination, "_COMPACT_EVERY", 5)
    index = build_index(TRAIN * 3)
    assert check(index, [("q", ITEM)]).items[0].ratio == 1.0
    expected = {h for text in TRAIN for h in ngram_hashes(normalize(text), 13).tolist()}
    assert set(index.hashes[13].tolist()) == expected


def test_hashes_are_stable_and_position_sensitive():
    words = ["one", "two", "three", "four"]
    assert ngram_hashes(words, 2).tolist() == ngram_hashes(list(words), 2).tolist()
    both_ways = ngram_hashes(words + words[::-1], 2).tolist()  # 7 bigrams, all distinct
    assert len(set(both_ways)) == 7
    assert both_ways[0] != both_ways[-1]  # (one, two) is not (two, one)
    assert ngram_hashes(words, 5).size == 0


def test_small_n_lowers_the_short_item_minimum():
    # --contamination_ngram 5: min_n follows n down, so 5..7-word items are checked too.
    index = build_index(["the quick brown fox jumps over it"], 5)
    assert index.min_n == 5
    (item,) = check(index, [("q", "The quick, brown fox jumps!")]).items
    assert (item.n_used, item.ratio) == (5, 1.0)


@pytest.mark.parametrize("kwargs", [{"n": 5, "min_n": 8}, {"n": 0, "min_n": 0}])
def test_bad_lengths_are_refused(kwargs):
    with pytest.raises(ConfigError, match="min_n <= n"):
        build_index(TRAIN, **kwargs)


def test_bad_threshold_is_refused():
    with pytest.raises(ConfigError, match=r"in \[0, 1\)"):
        check(build_index(TRAIN), [("q", ITEM)], threshold=1.0)


def test_texts_of_row_covers_the_dataset_layouts():
    chat = {
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        ]
    }
    assert texts_of_row(chat) == "Hi there\nHello!"
    alpaca = {"instruction": "Add", "input": "2 and 2", "output": "4", "system": "x"}
    assert texts_of_row(alpaca) == "Add\n2 and 2\n4"
    query = {"query": "Q2", "response": "R2", "history": [["Q1", "R1"]]}
    assert texts_of_row(query) == "Q1\nR1\nQ2\nR2"
    assert texts_of_row({"question": "Why?", "answer": "Because.", "id": 3}) == "Why?\nBecause."
    assert texts_of_row({"text": "plain"}) == "plain"
    assert texts_of_row({"label": 1}) == ""
