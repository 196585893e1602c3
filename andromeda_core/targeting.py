"""Targeting compiler: ad rules -> fixed-width column rows (the wire form; the index turns them into
clause refs, andromeda_core.clauses), request attributes -> the values a user holds per category.

Columns per category (N ads, G = max_groups, W = bitset words, L = max_values):
  bitset encoding: `<cat>.pos` (N, G, W) int32, `<cat>.neg` (N, W) int32; an all-zero group is unused.
  list encoding:   `<cat>.pos` (N, G, L) int16/int32 value indices padded with -1, `<cat>.neg` (N, L).
A positive group is satisfied when the user holds one of its values; the ad matches a category
when every used group is satisfied and the user holds none of `neg`.
For a single-valued category every positive form folds into one group (their intersection); an
empty intersection makes the whole ad unsatisfiable, as does a positive group whose every value is excluded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from andromeda_core.errors import InvalidInput, shown
from andromeda_core.schema import Category, Schema, attribute_values

RULE_KEYS = ("any_of", "all_of", "none_of", "min", "max")


@dataclass(frozen=True)
class ColumnSpec:
    shape: tuple[int, ...]  # per-ad shape
    dtype: torch.dtype
    fill: int


def list_dtype(cat: Category) -> torch.dtype:
    return torch.int16 if cat.size <= np.iinfo(np.int16).max else torch.int32


def targeting_columns(schema: Schema) -> dict[str, ColumnSpec]:
    """The targeting columns of `schema`, in schema order."""
    cols: dict[str, ColumnSpec] = {}
    for cat in schema.categories:
        if cat.encoding == "bitset":
            cols[f"{cat.name}.pos"] = ColumnSpec((cat.max_groups, cat.words), torch.int32, 0)
            cols[f"{cat.name}.neg"] = ColumnSpec((cat.words,), torch.int32, 0)
        else:
            cols[f"{cat.name}.pos"] = ColumnSpec((cat.max_groups, cat.max_values), list_dtype(cat), -1)
            cols[f"{cat.name}.neg"] = ColumnSpec((cat.max_values,), list_dtype(cat), -1)
    return cols


@dataclass(frozen=True)
class CompiledTargeting:
    """One ad's targeting: rows only for the categories it mentions (others keep the fill value)."""

    rows: dict[str, np.ndarray]
    satisfiable: bool


def _bitset(cat: Category, values: frozenset[int]) -> np.ndarray:
    """(W,) int32 with bit i set for each value index i (read-only)."""
    mask = 0
    for v in values:
        mask |= 1 << v
    return np.frombuffer(mask.to_bytes(4 * cat.words, "little"), dtype="<i4")


def _value_set(cat: Category, raw: Any, where: str, allow_empty: bool = False) -> frozenset[int]:
    if not isinstance(raw, list):
        raise InvalidInput(f"must be a list of values, got {type(raw).__name__}", where)
    if not raw and not allow_empty:
        raise InvalidInput("must name at least one value", where)
    out = set()
    for i, value in enumerate(raw):
        idx = cat.value_index(value)
        if idx is None:
            raise InvalidInput(f"{shown(value)} is not {cat.describe()}", f"{where}[{i}]")
        out.add(idx)
    if cat.encoding == "list" and len(out) > cat.max_values:
        raise InvalidInput(f"at most {cat.max_values} distinct values allowed for {cat.name}, got {len(out)}", where)
    return frozenset(out)


def _bound(cat: Category, rule: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = rule.get(key, default)
    if cat.value_index(value) is None:
        raise InvalidInput(f"{shown(value)} is not {cat.describe()}", f"{where}.{key}")
    return value


def parse_rule(cat: Category, rule: Any, where: str) -> tuple[list[frozenset[int]], frozenset[int]]:
    """A rule -> (positive groups of value indices, excluded value indices), before folding."""
    if not isinstance(rule, dict) or not rule:
        raise InvalidInput(f"a rule is a non-empty mapping with keys from {RULE_KEYS}", where)
    unknown = sorted(set(rule) - set(RULE_KEYS))
    if unknown:
        raise InvalidInput(f"unknown rule keys {unknown}; allowed: {RULE_KEYS}", where)
    groups: list[frozenset[int]] = []
    if "any_of" in rule:
        groups.append(_value_set(cat, rule["any_of"], f"{where}.any_of"))
    if "all_of" in rule:
        all_of = rule["all_of"]
        if not isinstance(all_of, list) or not all_of:
            raise InvalidInput("must be a non-empty list of value lists", f"{where}.all_of")
        groups.extend(_value_set(cat, g, f"{where}.all_of[{i}]") for i, g in enumerate(all_of))
    if "min" in rule or "max" in rule:
        if cat.kind != "ordinal":
            raise InvalidInput(f"min/max apply to ordinal categories only; {cat.name} is {cat.kind}", where)
        lo = _bound(cat, rule, "min", cat.lo, where)
        hi = _bound(cat, rule, "max", cat.hi, where)
        if lo > hi:
            raise InvalidInput(f"min {lo} is greater than max {hi}", where)
        groups.append(frozenset(range(lo - cat.lo, hi - cat.lo + 1)))
    excluded = _value_set(cat, rule["none_of"], f"{where}.none_of", allow_empty=True) if "none_of" in rule else frozenset()
    return groups, excluded


def fold_groups(cat: Category, groups: list[frozenset[int]], where: str) -> list[frozenset[int]] | None:
    """Groups as stored; None when no user can satisfy them (single-valued, empty intersection)."""
    if not cat.multi and groups:
        common = frozenset.intersection(*groups)
        return [common] if common else None
    unique = list(dict.fromkeys(groups))
    if len(unique) > cat.max_groups:
        raise InvalidInput(f"at most {cat.max_groups} positive groups allowed for {cat.name}, got {len(unique)}", where)
    return unique


def compile_targeting(schema: Schema, targeting: Any, where: str = "targeting") -> CompiledTargeting:
    if not isinstance(targeting, dict):
        raise InvalidInput("must be a mapping of category -> rule", where)
    rows: dict[str, np.ndarray] = {}
    satisfiable = True
    for name, rule in targeting.items():
        cat = schema.category(name, f"{where}.{name}")
        groups, excluded = parse_rule(cat, rule, f"{where}.{name}")
        folded = fold_groups(cat, groups, f"{where}.{name}")
        if folded is None:
            satisfiable = False
            folded = []
        elif any(group <= excluded for group in folded):  # a user holding one of its values holds an excluded one
            satisfiable = False
        if cat.encoding == "bitset":
            pos = np.zeros((cat.max_groups, cat.words), dtype=np.int32)
            for g, values in enumerate(folded):
                pos[g] = _bitset(cat, values)
            neg = _bitset(cat, excluded)
        else:
            pos = np.full((cat.max_groups, cat.max_values), -1, dtype=np.int32)
            for g, values in enumerate(folded):
                pos[g, : len(values)] = sorted(values)
            neg = np.full(cat.max_values, -1, dtype=np.int32)
            neg[: len(excluded)] = sorted(excluded)
        rows[f"{name}.pos"], rows[f"{name}.neg"] = pos, neg
    return CompiledTargeting(rows=rows, satisfiable=satisfiable)


UserValues = dict[str, tuple[int, ...]]
"""Category name -> sorted value indices the user holds (categories without values are absent)."""


def compile_user(schema: Schema, attributes: Mapping[str, Any], context: Mapping[str, Any]) -> tuple[UserValues, list[str]]:
    """A request's user attributes and context -> (values per category, warnings).

    Unknown categories (with a value or null) and malformed values raise InvalidInput; null for a known
    category is the same as leaving it out; a well-typed value outside the vocabulary matches nothing and yields a
    warning.
    """
    values: UserValues = {}
    warnings: list[str] = []
    for source, where, mapping in (("user", "user.attributes", attributes), ("context", "context", context)):
        for name, raw in mapping.items():
            cat = schema.category(name, f"{where}.{name}")  # an unknown category is refused, null or not
            if raw is None:
                continue
            if cat.source != source:
                raise InvalidInput(f"{name} is a {cat.source} category; send it in "
                                   f"{'context' if cat.source == 'context' else 'user.attributes'}", f"{where}.{name}")
            items = attribute_values(raw)
            if isinstance(raw, list) and not cat.multi:
                raise InvalidInput(f"{name} holds one value per user: send it as a single value, not a list",
                                   f"{where}.{name}")
            expected = str if cat.kind == "enum" else int
            held = set()
            for i, value in enumerate(items):
                field = f"{where}.{name}[{i}]" if isinstance(raw, list) else f"{where}.{name}"
                if isinstance(value, bool) or not isinstance(value, expected):
                    raise InvalidInput(f"{name} values are {'strings' if expected is str else 'integers'}, "
                                       f"got {type(value).__name__}", field)
                idx = cat.value_index(value)
                if idx is None:
                    warnings.append(f"{field}: unknown value {shown(value)} matches nothing")
                else:
                    held.add(idx)
            if held:
                values[name] = tuple(sorted(held))
    return values, warnings
