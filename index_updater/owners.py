"""The owner registry: which advertiser owns each ad, decided where the ad's events are appended.

Per shard stream `S`, the hash `S:owners{S}` maps ad id -> "version advertiser_id" (advertiser "" once deleted:
the id is free again). Its name starts with the stream's, so an ACL pattern for the streams covers it, and its
hash tag is the stream's whole name, so Redis Cluster keeps it in the stream's slot: one script reads and writes
both. Every publish goes through `APPEND` (one Lua script per shard stream, atomic like the MULTI/EXEC
it replaces): it appends the entries and records, for each upsert or delete at least as new as the recorded
version, the new owner. Given an advertiser, it first checks every event of the batch against the registry and
appends nothing if one touches another's ad: an upsert needs the ad free or its own, a delete, pause or resume
its own. So two advertisers racing for one id, or one claiming an ad published but not yet applied, cannot both
pass: Redis orders the two scripts. An ad published before the registry existed has no entry: the check then
reads the owner the index reported (`index_owners`), and the first write records it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import redis

from andromeda_core.errors import Forbidden
from andromeda_core.ops import PreparedAd

APPEND = """
local mine, check_only, n = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
local at, known, events = 4, {}, {}
local function owner_of(ad, index_owner)
  if known[ad] then return known[ad] end
  local stored = redis.call('HGET', KEYS[2], ad)
  if not stored then return {-1, index_owner} end
  local space = string.find(stored, ' ', 1, true)
  return {tonumber(string.sub(stored, 1, space - 1)), string.sub(stored, space + 1)}
end
for i = 1, n do
  local kind, ad, version, advertiser = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2]), ARGV[at + 3]
  local owner, fields = owner_of(ad, ARGV[at + 4]), tonumber(ARGV[at + 5])
  if mine ~= '' and owner[2] ~= mine and (kind ~= 'upsert' or owner[2] ~= '') then
    return {'refused', i - 1, owner[2]}
  end
  if (kind == 'upsert' or kind == 'delete') and version >= owner[1] then
    known[ad] = {version, kind == 'upsert' and advertiser or ''}
  end
  events[i] = {at + 6, at + 5 + 2 * fields}
  at = at + 6 + 2 * fields
end
if check_only then return {'ok'} end
local ids = {}
for i = 1, n do
  ids[i] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, events[i][1], events[i][2]))
end
for ad, owner in pairs(known) do
  redis.call('HSET', KEYS[2], ad, owner[1] .. ' ' .. owner[2])
end
return {'ok', ids}
"""


def owners_key(stream: str) -> str:
    """The owner registry of shard stream `stream` (in its Redis Cluster slot: the hash tag is the stream's name)."""
    return f"{stream}:owners{{{stream}}}"


@dataclass(frozen=True)
class Writer:
    """Who appends: `advertiser` None for an admin (no check); else the advertiser id every event must stay within,
    with `index_owners` (ad id -> owner the index reported, None: not indexed) for ads the registry lacks."""

    advertiser: int | None = None
    index_owners: dict[int, int | None] | None = None


ADMIN = Writer()


def script_args(ops: Sequence, entries: Sequence[dict], writer: Writer, check_only: bool) -> list:
    """APPEND's ARGV for ops (n,) and their stream entries (n,)."""
    args: list = ["" if writer.advertiser is None else str(writer.advertiser), "1" if check_only else "0", len(ops)]
    for op, fields in zip(ops, entries):
        upsert = isinstance(op, PreparedAd)
        ad_id = op.ad.ad_id if upsert else op.ad_id
        indexed = (writer.index_owners or {}).get(ad_id)
        args += [fields["op"], ad_id, fields["version"], op.ad.advertiser_id if upsert else "",
                 "" if indexed is None else indexed, len(fields)]
        for name, value in fields.items():
            args += [name, value]
    return args


class Refused(Forbidden):
    """An event of the batch touches another advertiser's ad; nothing was appended to its shard."""


def run_append(client: redis.Redis, stream: str, ops: Sequence, entries: Sequence[dict], writer: Writer,
               check_only: bool = False, where: Sequence[str] | None = None) -> list:
    """APPEND on one shard stream -> the new entries' ids (n,) ([] when check_only); Refused naming the event
    (`where[i]`, default "[i]") when the writer may not touch its ad."""
    reply = client.eval(APPEND, 2, stream, owners_key(stream), *script_args(ops, entries, writer, check_only))
    if reply[0] in (b"refused", "refused"):
        i, owner = int(reply[1]), reply[2].decode() if isinstance(reply[2], bytes) else reply[2]
        field = "ad.ad_id" if isinstance(ops[i], PreparedAd) else "ad_id"
        name = where[i] if where else f"[{i}]"
        ad_id = ops[i].ad.ad_id if isinstance(ops[i], PreparedAd) else ops[i].ad_id
        raise Refused(f"ad {ad_id} " + ("belongs to another advertiser (an ad cannot be moved)" if owner else
                                        f"is not advertiser {writer.advertiser}'s"), f"{name}.{field}")
    return [] if check_only else list(reply[1])
