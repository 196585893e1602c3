from __future__ import annotations

from collections import Counter

import pytest

from andromeda_core.errors import InvalidInput
from andromeda_core.schema import DEFAULT_SCHEMA_PATH, load_schema, read_yaml


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


def test_yaml_refuses_a_key_twice_but_keeps_merge_keys(tmp_path):
    """A mapping naming a key twice is refused (its last value would win unseen); `<<: *anchor` merges as YAML
    means, the mapping's own keys overriding the merged ones."""
    merged = tmp_path / "merged.yaml"
    merged.write_text("name: m\ncategories:\n  - &base {name: country, kind: enum, vocabulary: [US, CA]}\n"
                      "  - <<: *base\n    name: lang\n")
    assert [c.name for c in load_schema(merged).categories] == ["country", "lang"]
    twice = tmp_path / "twice.yaml"
    twice.write_text("a: 1\nb: {c: 1, c: 2}\n")
    with pytest.raises(InvalidInput, match="'c' appears twice") as error:
        read_yaml(twice)
    assert error.value.field == f"{twice}:2"


def test_the_shipped_schema_parsed_once_builds_the_same_schema_each_time(tmp_path):
    """load_schema() parses the shipped YAML once per process and builds each schema from a copy of it: after
    loads, the same schema as a copy of the file read afresh; any other file is read at each load."""
    first, second = load_schema(), load_schema()
    copy = tmp_path / "copy.yaml"
    copy.write_text(DEFAULT_SCHEMA_PATH.read_text())
    assert first == second == load_schema(copy) and first is not second
    copy.write_text("name: other\ncategories:\n  - {name: country, kind: enum, vocabulary: [US]}\n")
    assert [c.name for c in load_schema(copy).categories] == ["country"]
