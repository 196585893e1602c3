"""The owner registry: which advertiser owns each ad, decided where the ad's events are appended.

Per shard stream `S`, the hash `S:owners{S}` maps ad id -> "version owner[ status]": the newest upsert or delete
version appended, the advertiser whose ad it is ("" once deleted: the id is free again), and the version of the
newest pause or resume appended where it is newer than that version (as the index keeps it). Its name starts with
the stream's, so an ACL pattern for the streams covers it, and its hash tag is the stream's whole name, so Redis
Cluster keeps it in the stream's slot: one script reads and writes both. Versions stay decimal strings (compared
by length, then digits): they reach 2**63 - 1, past what a Lua number holds exactly.

Every publish goes through `APPEND` (one Lua script per shard stream, atomic): it appends the entries and records,
for each event strictly newer than the recorded version (as the index applies them), the new owner or status.
Given an advertiser, it first checks every event of the batch and appends nothing if one touches another's ad:
an upsert must name the advertiser and needs the ad free or its own; a delete, pause or resume needs the ad its
own, unless its version is not newer than the recorded one nor the index's: the index ignores it then, so a
resend passes whoever owns the ad now. A delete must also not be older than the ad's recorded pause or resume: the index
keeps a status newer than a delete, so the id's next owner would get its ad paused (or active). So two
advertisers racing for one id, or one claiming an ad published but not yet applied, cannot both pass: Redis
orders the two scripts. A call carries a token (`run_append`): resent after its reply was lost, it returns what the
first run appended instead of running again. Where the writer sends the owner, content version and status version its shard's index
reports (`Writer.indexed`: the router does for advertisers), the index's state counts where newer than the entry:
the index applied what the registry did not see (an ad published before it existed, a write Redis lost) or saw
wrongly (an admin's stale write on such an ad, appended without the index's state and ignored by the index); at
equal versions the index's ad counts, live or deleted (a write at that version it ignored). A status is kept while it is newer
than the content that counts. A delete, pause or resume that the index would still apply (newer than the version
it reports) needs the ad its writer's even where the registry is ahead (an entry it recorded that the index
refused, or one a lagging replica has not applied yet: a former owner's resend is refused then). A malformed
entry, or a key of another type, counts as none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from redis.commands.core import Script

from andromeda_core.errors import Forbidden

APPEND = """
local mine, check_only, n = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
if KEYS[3] then  -- the call's token: a resend of a call that ran (its reply lost) gets that run's ids, appends nothing
  local sent = redis.call('GET', KEYS[3])
  if sent then return {'ok', cjson.decode(sent)} end
end
local kind_of_key = redis.call('TYPE', KEYS[2]).ok
local usable = kind_of_key == 'hash' or kind_of_key == 'none'
local function newer(a, b)
  if b == '' then return true end
  if a == '' then return false end
  if #a ~= #b then return #a > #b end
  return a > b
end
local at, known, events, index_at = 4, {}, {}, {}  -- index_at: the content version the index will hold after
-- this batch's earlier events of an ad that reach it (a repeat of one of them within the batch reaches it no more)
local function state_of(ad, indexed_version, indexed_owner, indexed_status)
  if known[ad] then return known[ad] end
  local stored, version, owner, status = usable and redis.call('HGET', KEYS[2], ad)
  if stored then version, owner, status = string.match(stored, '^(%d*) (%d*) ?(%d*)$') end
  if not version then version, owner, status = '', '', '' end  -- no entry, or a malformed one
  -- the index applied what the registry did not see (before it existed, a write Redis lost) or took a write the
  -- registry recorded wrongly (an admin's stale one, sent without the index's state): its newer content counts,
  -- and its ad at the registry's version, live or deleted (a write at that version the index ignored)
  if indexed_version ~= '' and (newer(indexed_version, version) or indexed_version == version) then
    version, owner = indexed_version, indexed_owner
  end
  if indexed_status ~= '' and newer(indexed_status, status) then status = indexed_status end
  return {version, owner, newer(status, version) and status or ''}
end
for i = 1, n do
  local kind, ad, version, advertiser, indexed = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  local state, fields = state_of(ad, indexed, ARGV[at + 5], ARGV[at + 6]), tonumber(ARGV[at + 7])
  if index_at[ad] then indexed = index_at[ad] end
  local applies = newer(version, state[1])
  local reaches = applies or newer(version, indexed)  -- the index, behind the registry, would still apply it
  if reaches and (kind == 'upsert' or kind == 'delete') then index_at[ad] = version end
  if mine ~= '' then
    if kind == 'upsert' then
      if not (advertiser == mine and (state[2] == mine or state[2] == '')) then return {'refused', i - 1, state[2]} end
    elseif reaches and state[2] ~= mine then
      return {'refused', i - 1, state[2]}
    elseif reaches and kind == 'delete' and newer(state[3], version) then
      return {'refused', i - 1, state[2], state[3]}
    end
  end
  if applies and (kind == 'upsert' or kind == 'delete') then
    state = {version, kind == 'upsert' and advertiser or '', newer(state[3], version) and state[3] or ''}
  elseif applies and newer(version, state[3]) then  -- a pause or resume newer than the content and the status
    state = {state[1], state[2], version}
  end
  known[ad] = state
  events[i] = {at + 8, at + 7 + 2 * fields}
  at = at + 8 + 2 * fields
end
if check_only then return {'ok'} end
if not usable then redis.call('DEL', KEYS[2]) end
local ids = {}
for i = 1, n do
  ids[i] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, events[i][1], events[i][2]))
end
for ad, state in pairs(known) do  -- nothing yet: an ad never upserted, deleted, paused nor resumed
  if state[1] ~= '' or state[3] ~= '' then
    redis.call('HSET', KEYS[2], ad, state[1] .. ' ' .. state[2] .. (state[3] ~= '' and ' ' .. state[3] or ''))
  end
end
if KEYS[3] and n > 0 then redis.call('SET', KEYS[3], cjson.encode(ids), 'EX', ARGV[#ARGV]) end
return {'ok', ids}
"""
SENT_TTL_S = 600  # how long a call's token answers its resends: past the publisher's default retries (about 2 minutes)


def sent_key(stream: str, token: str) -> str:
    """Where APPEND keeps the ids a call with this token appended to shard stream `stream` (in the stream's slot)."""
    return f"{stream}:sent{{{stream}}}:{token}"


def owners_key(stream: str) -> str:
    """The owner registry of shard stream `stream` (in its Redis Cluster slot: the hash tag is the stream's name)."""
    return f"{stream}:owners{{{stream}}}"


@dataclass(frozen=True)
class Writer:
    """Who appends: `advertiser` None for an admin (no check); else the advertiser every event must stay within; with
    `indexed` (ad id -> (owner or None, content version or None, status version or None) as the index reports it
    (AdIndex.owners_of), which the registry takes where newer than its entry (an ad missing from it: none
    reported)."""

    advertiser: int | None = None
    indexed: dict[int, tuple[int | None, ...]] = field(default_factory=dict)


ADMIN = Writer()


def claim_of(event: Any) -> tuple[str, int, int, Any]:
    """(kind, ad id, version, advertiser or "") of an ad event or a prepared op (an upsert has `ad`)."""
    if hasattr(event, "ad"):
        return "upsert", event.ad.ad_id, event.ad.version, event.ad.advertiser_id
    return event.op, event.ad_id, event.version, ""


def script_args(events: Sequence, entries: Sequence[dict] | None, writer: Writer) -> list:
    """APPEND's ARGV for events (n,) and their stream entries (n,; None: check only, no fields sent)."""
    args: list = ["" if writer.advertiser is None else writer.advertiser, "1" if entries is None else "0", len(events)]
    for i, event in enumerate(events):
        kind, ad_id, version, advertiser = claim_of(event)
        owner, content, status = (*writer.indexed.get(ad_id, ()), None, None, None)[:3]  # shards of before 2026-12-05
        fields = {} if entries is None else entries[i]  # report no status
        args += [kind, ad_id, version, advertiser, *("" if v is None else v for v in (content, owner, status)),
                 len(fields)]
        for name, value in fields.items():
            args += [name, value]
    return args


class Refused(Forbidden):
    """An event of the batch touches another advertiser's ad; nothing was appended to its shard."""


def run_append(append: Script, stream: str, events: Sequence, entries: Sequence[dict] | None, writer: Writer,
               where: Sequence[str], token: str = "") -> list:
    """APPEND (`append`: it registered with a client) on one shard stream: events (n,) with their entries (n,) ->
    the new entries' ids (n,); entries None: only check, -> []. Refused naming the event (where[i]) when the writer
    may not touch its ad. token: unique to this call, the same on its resends: a resend of a call that ran (its
    reply lost) returns the ids that run appended, and appends and checks nothing again (without it, an advertiser's
    resent delete found the id free and was refused)."""
    keys = [stream, owners_key(stream), *([sent_key(stream, token)] if token and entries is not None else [])]
    reply = append(keys=keys, args=[*script_args(events, entries, writer), SENT_TTL_S])
    if reply[0] in (b"refused", "refused"):
        i, owner, *status = (int(reply[1]), *(v.decode() if isinstance(v, bytes) else v for v in reply[2:]))
        kind, ad_id, version, advertiser = claim_of(events[i])
        if kind == "upsert" and advertiser != writer.advertiser:
            raise Refused(f"advertiser {writer.advertiser} may only upsert ads naming it, not advertiser {advertiser}",
                          f"{where[i]}.ad.advertiser_id")
        if status:
            raise Refused(f"ad {ad_id} has a pause or resume at version {status[0]}: a delete at {version} would leave "
                          "that status to the id's next owner; delete it at a version at least as new",
                          f"{where[i]}.version")
        field, moving = ("ad.ad_id", " (an ad cannot be moved)") if kind == "upsert" else ("ad_id", "")
        raise Refused(f"ad {ad_id} " + (f"belongs to another advertiser{moving}" if owner else
                                        f"is not advertiser {writer.advertiser}'s"), f"{where[i]}.{field}")
    return [] if entries is None else list(reply[1])
