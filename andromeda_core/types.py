"""Wire contracts (README 'API') as typed models, and parsing that names the bad field."""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from andromeda_core import strict_json
from andromeda_core.errors import InvalidInput

INT64 = Annotated[int, Field(ge=0, lt=2**63)]
FLOAT32_MAX = 3.4028234663852886e38  # bids are stored as float32
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number: a positive bid below it would be stored as 0
# or lose its precision
TIME_LIMIT = 2**62  # times (seconds) are in [0, TIME_LIMIT); the match compares them as int64
TIME = Annotated[int, Field(ge=0, lt=TIME_LIMIT)]


K_MAX = 10_000  # the largest k a retrieval request may ask for
HISTORY_MAX, COHORTS_MAX, CO_ENGAGEMENT_MAX = 1024, 256, 1024  # the most entries of each list in `user`


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Creative(_Strict):
    title: str = Field(max_length=512)
    body: str = Field(default="", max_length=4096)
    category: str = Field(default="", max_length=128)


class Ad(_Strict):
    ad_id: INT64
    advertiser_id: INT64
    version: INT64
    status: Literal["active", "paused"] = "active"
    start_time: TIME | None = None
    end_time: TIME | None = None
    creative: Creative
    bid: float = Field(ge=0, le=FLOAT32_MAX, allow_inf_nan=False)
    targeting: dict[str, Any] = Field(default_factory=dict)

    @field_validator("bid")
    @classmethod
    def _storable(cls, bid: float) -> float:
        if 0 < bid < FLOAT32_TINY:
            raise PydanticCustomError("bid_too_small", "must be 0 or at least {tiny} (bids are stored as float32)",
                                      {"tiny": FLOAT32_TINY})
        return bid + 0.0  # -0.0 as 0.0: one stored form for a zero bid

    @field_validator("end_time")
    @classmethod
    def _after_start(cls, end: int | None, info: ValidationInfo) -> int | None:
        start = info.data.get("start_time")
        if start is not None and end is not None and start >= end:
            raise PydanticCustomError("time_window", "must be after start_time ({start})", {"start": start})
        return end


class UpsertEvent(_Strict):
    op: Literal["upsert"]
    ad: Ad


class DeleteEvent(_Strict):
    op: Literal["delete"]
    ad_id: INT64
    version: INT64


class StatusEvent(_Strict):
    op: Literal["pause", "resume"]
    ad_id: INT64
    version: INT64


AdEvent = Annotated[Union[UpsertEvent, DeleteEvent, StatusEvent], Field(discriminator="op")]


class HistoryEvent(_Strict):
    ad_id: INT64
    event: Literal["impression", "click", "like", "share", "conversion", "hide"]
    ts: TIME


class CoEngagement(_Strict):
    """An engagement on another surface (cross-surface signal)."""

    surface: str  # bounded by the service's limits.string_chars, as context's strings
    ad_id: INT64
    count: int = Field(default=1, ge=1, lt=2**31)


class User(_Strict):
    user_id: INT64
    attributes: dict[str, Any] = Field(default_factory=dict)
    history: list[HistoryEvent] = Field(default_factory=list, max_length=HISTORY_MAX)
    cohorts: list[INT64] = Field(default_factory=list, max_length=COHORTS_MAX)
    co_engagement: list[CoEngagement] = Field(default_factory=list, max_length=CO_ENGAGEMENT_MAX)


class Context(BaseModel):
    """Serving context. Extra keys are context-sourced targeting categories, checked by the schema."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    surface: Any = None
    """Where the ad would be shown: a targeting category where the schema declares one (of whatever kind, one value or
    several, as it says; until 2026-12-07 only one string), and an input of the models' context tower."""
    placement: Any = None
    """As surface."""
    ts: TIME | None = None

    def targeting_values(self) -> dict[str, Any]:
        """The context's targeting values as sent (surface and placement only where given: a schema may not have
        them)."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if k != "ts"}


class RetrieveRequest(_Strict):
    user: User
    context: Context = Field(default_factory=Context)
    k: int = Field(default=100, ge=1, le=K_MAX)
    allow_partial: bool = False
    """Service only: answer from the shards that respond instead of failing when one does not."""


class ScoredAd(_Strict):
    ad_id: int
    score: float


class RetrieveResponse(_Strict):
    ads: list[ScoredAd]
    eligible: int
    index_watermark: str | None = None
    """Stream id up to which every shard had applied its updates (None: some shard has applied none)."""
    shard_watermarks: list[str | None] = Field(default_factory=list)
    """Service only: each shard's newest applied stream id."""
    missing_shards: list[int] = Field(default_factory=list)
    """Service only, with allow_partial: shards that did not answer (their ads are missing)."""
    took_ms: float
    warnings: list[str] = Field(default_factory=list)


T = TypeVar("T")
_EVENT = TypeAdapter(AdEvent)


def field_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location -> the field path users see: `user.history[3].ts` (event op tags dropped)."""
    parts = [str(p) for p in loc if p not in ("upsert", "delete", "pause", "resume")]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def error_field(loc: tuple[Any, ...], kind: str) -> str:
    """The field path of one pydantic error; a missing or unknown event op names `op`."""
    field = field_path(loc)
    if kind.startswith("union_tag"):
        return f"{field}.op" if field != "body" else "op"
    return field


def not_text(value: Any) -> bool:
    """Whether value is a string that UTF-8 cannot encode (it holds a lone surrogate)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def within(where: str, path: str) -> str:
    """A field path inside what `where` names (a file and line: `events.jsonl:3.ad.bid`); "body" for neither."""
    return f"{where}{'.' if where and path else ''}{path}" or "body"


def parse(adapter: TypeAdapter[T] | type[T], data: Any, where: str = "", strict: bool = True) -> T:
    """Validate `data` (a dict, or JSON text) into a model; errors name the first bad field. JSON text must be UTF-8
    with no key twice in an object and no NaN or Infinity, unless `strict` is False (text this service wrote: the
    stream's entries, read at the apply rate)."""
    ta = adapter if isinstance(adapter, TypeAdapter) else TypeAdapter(adapter)
    doc = data  # the document as read, where the error below looks for a lone surrogate
    try:
        if isinstance(data, (str, bytes)):
            if strict:
                doc = strict_json.read(data, where or "body")
            text = data
        else:  # validated with JSON semantics, so that a Python dict and its JSON text are judged alike
            text = json.dumps(data, allow_nan=False)
        return ta.validate_json(text)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid" and (strict or not isinstance(data, (str, bytes))):  # text json.loads
            found = strict_json.path_of(doc, not_text)
            raise InvalidInput("a string holds a lone surrogate (\\ud800-\\udfff without its pair): not text",
                               within(where, found[0] if found else "")) from None  # read, or wrote: only a lone
            # surrogate is left; in a key (found: None), the event or request is named
        field = error_field(err["loc"], err["type"])  # "body": the whole event or request, which `where` names
        raise InvalidInput(err["msg"], where if where and field == "body" else within(where, field)) from None
    except RecursionError:  # a dict nested too deeply for json.dumps
        raise InvalidInput("JSON nested too deeply", where or "body") from None
    except (TypeError, ValueError) as exc:  # a dict json.dumps cannot write (NaN, Infinity, a value of no JSON type)
        if isinstance(exc, ValueError) and "Out of range float" in str(exc) and (found := strict_json.path_of(
                data, lambda value: isinstance(value, float) and not math.isfinite(value))):
            raise InvalidInput(f"{found[1]} is not a JSON number (send a finite one)", within(where, found[0])) from None
        raise InvalidInput(str(exc), where or "body") from None


def parse_event(data: Any, where: str = "", strict: bool = True) -> UpsertEvent | DeleteEvent | StatusEvent:
    return parse(_EVENT, data, where, strict)


def parse_request(data: Any, where: str = "") -> RetrieveRequest:
    return parse(RetrieveRequest, data, where)
