"""Targeting schema: the categories an ad may target and how each compiles to device columns.

A category of at most BITSET_MAX_VALUES values compiles to bitset words (int32, 32 values a
word); a larger one (big enums, `id` spaces) to fixed-width lists of value indices.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from andromeda_core.errors import InvalidInput, shown

DEFAULT_SCHEMA_PATH = Path(__file__).parent / "data" / "default_schema.yaml"
BITSET_MAX_VALUES = 256
KINDS = ("enum", "ordinal", "id")
SOURCES = ("user", "context")


def attribute_values(raw: Any) -> list:
    """A user attribute's or context field's values: a multi-valued one is sent as a list, one value as itself."""
    return raw if isinstance(raw, list) else [raw]


@dataclass(frozen=True)
class Category:
    name: str
    kind: str
    multi: bool = False
    source: str = "user"
    vocabulary: tuple[str, ...] = ()
    lo: int = 0
    hi: int = -1
    cardinality: int = 0
    max_values: int = 8
    """List encoding only: most values one group or one none_of may name."""
    max_groups: int = 1
    """Most positive groups (any_of, each all_of group, min/max) kept after folding."""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def size(self) -> int:
        """Number of distinct values; values are indexed 0..size-1."""
        if self.kind == "enum":
            return len(self.vocabulary)
        if self.kind == "ordinal":
            return self.hi - self.lo + 1
        return self.cardinality

    @cached_property
    def encoding(self) -> str:
        return "bitset" if self.kind != "id" and self.size <= BITSET_MAX_VALUES else "list"

    @cached_property
    def words(self) -> int:
        """int32 words of one bitset (bitset encoding only)."""
        return (self.size + 31) // 32

    def value_index(self, value: Any) -> int | None:
        """Index of `value` in 0..size-1, or None when it is not a value of this category."""
        if self.kind == "enum":
            return self._index.get(value) if isinstance(value, str) else None
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        if self.kind == "ordinal":
            return value - self.lo if self.lo <= value <= self.hi else None
        return value if 0 <= value < self.cardinality else None

    def value_at(self, index: int) -> str | int:
        if self.kind == "enum":
            return self.vocabulary[index]
        return index + self.lo if self.kind == "ordinal" else index

    def describe(self) -> str:
        if self.kind == "enum":
            return f"one of the {self.size} {self.name} vocabulary values"
        if self.kind == "ordinal":
            return f"an integer in [{self.lo}, {self.hi}]"
        return f"an integer id in [0, {self.cardinality})"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "multi": self.multi,
                               "source": self.source, "encoding": self.encoding}
        if self.kind == "enum":
            out["vocabulary"] = list(self.vocabulary)
        elif self.kind == "ordinal":
            out["range"] = [self.lo, self.hi]
        else:
            out["cardinality"] = self.cardinality
        out["max_groups"] = self.max_groups
        if self.encoding == "list":
            out["max_values"] = self.max_values
        return out


@dataclass(frozen=True)
class Schema:
    name: str
    version: int
    categories: tuple[Category, ...]
    by_name: dict[str, Category] = field(compare=False, repr=False)

    @property
    def bitset_categories(self) -> tuple[Category, ...]:
        return tuple(c for c in self.categories if c.encoding == "bitset")

    @property
    def list_categories(self) -> tuple[Category, ...]:
        return tuple(c for c in self.categories if c.encoding == "list")

    def category(self, name: str, field_path: str) -> Category:
        try:
            return self.by_name[name]
        except KeyError:
            raise InvalidInput(f"unknown targeting category {shown(name)}", field_path) from None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version,
                "categories": [c.to_json() for c in self.categories]}

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the whole content (16 hex digits): two schemas of one name and version may still differ (a
        vocabulary reordered without a new version), and an index's bits mean values by their place."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def has_fingerprint(self, recorded: str | None) -> bool:
        """Whether a fingerprint recorded with something written under this schema's name and version is this
        schema's; None (written before fingerprints were recorded, 2026-12-05) is taken as a match."""
        return recorded is None or recorded == self.fingerprint


def _category_from_dict(raw: Any, where: str) -> Category:
    if not isinstance(raw, dict):
        raise InvalidInput("must be a mapping", where)
    allowed = {"name", "kind", "multi", "source", "vocabulary", "range", "cardinality", "max_values", "max_groups"}
    extra = set(raw) - allowed
    if extra:
        raise InvalidInput(f"unknown keys {sorted(extra)}", where)
    name, kind = raw.get("name"), raw.get("kind")
    if not isinstance(name, str) or not name:
        raise InvalidInput("name must be a non-empty string", f"{where}.name")
    where = f"categories.{name}"
    if kind not in KINDS:
        raise InvalidInput(f"kind must be one of {KINDS}, got {shown(kind)}", f"{where}.kind")
    source = raw.get("source", "user")
    if source not in SOURCES:
        raise InvalidInput(f"source must be one of {SOURCES}", f"{where}.source")
    if source == "context" and name == "ts":  # context.ts is the request's time: it never reaches targeting
        raise InvalidInput("context.ts is the request's time, not a targeting category: choose another name",
                           f"{where}.name")
    multi = raw.get("multi", False)
    if not isinstance(multi, bool):
        raise InvalidInput("multi must be true or false", f"{where}.multi")
    kwargs: dict[str, Any] = {}
    if kind == "enum":
        vocab = raw.get("vocabulary")
        if not isinstance(vocab, list) or not vocab or not all(isinstance(v, str) for v in vocab):
            raise InvalidInput("an enum needs a non-empty list of strings", f"{where}.vocabulary")
        if len(set(vocab)) != len(vocab):
            raise InvalidInput("vocabulary has duplicates", f"{where}.vocabulary")
        kwargs["vocabulary"] = tuple(vocab)
        kwargs["_index"] = {v: i for i, v in enumerate(vocab)}
    elif kind == "ordinal":
        rng = raw.get("range")
        if (not isinstance(rng, list) or len(rng) != 2 or not all(type(v) is int for v in rng)
                or not 0 < rng[1] - rng[0] + 1 <= BITSET_MAX_VALUES):
            raise InvalidInput(f"an ordinal needs [lo, hi] integers spanning 1..{BITSET_MAX_VALUES} values",
                               f"{where}.range")
        kwargs["lo"], kwargs["hi"] = rng
    else:
        card = raw.get("cardinality")
        if type(card) is not int or not 0 < card < 2**31:
            raise InvalidInput("an id category needs a cardinality in [1, 2^31)", f"{where}.cardinality")
        kwargs["cardinality"] = card
    for key, default in (("max_values", 8), ("max_groups", 2 if multi else 1)):
        value = raw.get(key, default)
        if type(value) is not int or not 1 <= value <= 64:
            raise InvalidInput("must be an integer in [1, 64]", f"{where}.{key}")
        kwargs[key] = value
    return Category(name=name, kind=kind, multi=multi, source=source, **kwargs)


def schema_from_dict(raw: Any) -> Schema:
    if not isinstance(raw, dict) or not isinstance(raw.get("categories"), list):
        raise InvalidInput("a schema is a mapping with a list of categories", "categories")
    if unknown := sorted(set(raw) - {"name", "version", "categories"}, key=str):
        raise InvalidInput("unknown key (a schema has name, version and categories)", str(unknown[0]))
    version = raw.get("version", 1)
    if type(version) is not int:
        raise InvalidInput("must be an integer", "version")
    cats = tuple(_category_from_dict(c, f"categories[{i}]") for i, c in enumerate(raw["categories"]))
    by_name = {c.name: c for c in cats}
    if len(by_name) != len(cats):
        raise InvalidInput("category names must be unique", "categories")
    return Schema(name=str(raw.get("name", "custom")), version=version, categories=cats, by_name=by_name)


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing a mapping that names a key twice (SafeLoader keeps the last: `shards: 2` then
    `shards: 3` would read 3 without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: explicit keys override merged ones
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):  # unhashable: SafeLoader refuses it below
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; a file that is not YAML text, or names a key twice in one mapping, is an InvalidInput
    naming it (and the line)."""
    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"not UTF-8 text (byte {exc.start})", str(path)) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise InvalidInput("YAML nested too deeply", str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InvalidInput(f"not YAML: {problem}", f"{path}:{mark.line + 1}" if mark else str(path)) from None


@functools.lru_cache(maxsize=1)
def _shipped_yaml() -> Any:
    """The shipped default schema's YAML, parsed once per process (0.2 s a parse, and the training and evaluation
    code loads it many times); load_schema builds from a copy."""
    return read_yaml(DEFAULT_SCHEMA_PATH)


def load_schema(path: str | Path | None = None) -> Schema:
    """Load a schema YAML; None loads the shipped default. Errors name the file."""
    path = path or DEFAULT_SCHEMA_PATH
    raw = copy.deepcopy(_shipped_yaml()) if Path(path) == DEFAULT_SCHEMA_PATH else read_yaml(path)
    try:
        return schema_from_dict(raw)
    except InvalidInput as exc:
        raise exc.at(str(path)) from None
