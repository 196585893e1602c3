from __future__ import annotations

from collections import Counter


def test_default_schema_has_the_promised_breadth(default_schema):
    kinds = Counter(c.kind for c in default_schema.categories)
    assert len(default_schema.categories) >= 20 and set(kinds) == {"enum", "ordinal", "id"}
    by = default_schema.by_name
    assert {"US", "CA", "DE", "JP", "BR", "IN", "NO"} <= set(by["country"].vocabulary) and by["country"].size >= 240
    assert {"en", "es", "zh", "hi"} <= set(by["language"].vocabulary)
    assert by["interests"].size >= 1000 and {"running", "yoga"} <= set(by["interests"].vocabulary)
    assert by["behaviors"].size >= 500 and by["custom_audiences"].cardinality >= 1_000_000
    assert by["surface"].source == by["placement"].source == "context"


def test_encodings_follow_vocabulary_size(default_schema):
    by = default_schema.by_name
    assert by["country"].encoding == "bitset" and by["country"].words == 8
    assert by["interests"].encoding == "list" and by["custom_audiences"].encoding == "list"
    assert by["age"].encoding == "bitset" and by["age"].value_index(13) == 0 and by["age"].value_index(101) is None
    assert by["gender"].value_index(1) is None and by["custom_audiences"].value_index(True) is None
