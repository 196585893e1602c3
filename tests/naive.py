"""A naive evaluator of the targeting contract (README 'Targeting'), written from the text alone.

It works on raw JSON values (no compilation, no bitsets) so the index can be checked against it.
"""
from __future__ import annotations

from typing import Any


def held_values(schema, attributes: dict[str, Any], context: dict[str, Any]) -> dict[str, set]:
    """Category -> the known values the user holds (unknown values match nothing, so they are dropped)."""
    held: dict[str, set] = {}
    for mapping in (attributes, context):
        for name, raw in mapping.items():
            if raw is None or name not in schema.by_name:
                continue
            cat = schema.by_name[name]
            values = raw if isinstance(raw, list) else [raw]
            held[name] = {v for v in values if cat.value_index(v) is not None}
    return held


def naive_eligible(schema, ad: dict[str, Any], attributes: dict[str, Any], context: dict[str, Any], now: int) -> bool:
    if ad.get("status", "active") != "active":
        return False
    if ad.get("start_time") is not None and not ad["start_time"] <= now:
        return False
    if ad.get("end_time") is not None and not now < ad["end_time"]:
        return False
    held = held_values(schema, attributes, context)
    for name, rule in ad.get("targeting", {}).items():
        values = held.get(name, set())
        if "any_of" in rule and not values & set(rule["any_of"]):
            return False
        for group in rule.get("all_of", []):
            if not values & set(group):
                return False
        if "min" in rule or "max" in rule:
            lo, hi = rule.get("min", float("-inf")), rule.get("max", float("inf"))
            if not any(lo <= v <= hi for v in values):
                return False
        if values & set(rule.get("none_of", [])):
            return False
    return True
