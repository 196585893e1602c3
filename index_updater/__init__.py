"""Real-time index updates through Redis streams, one per index shard.

- records: the stream entry format (validated event + compiled targeting + ad-tower embedding), the
  stream names (`shard_stream(base, s)`, `dead_letter_stream(base)`) and the batch decoder.
- publisher.Publisher: validate, compile, embed, XADD each entry to its shard's stream (one atomic Lua
  script per shard stream and batch, retried (within about `timeout_s` where given: `Publisher.bounded`, the
  router's), which also keeps the shard's owner registry: owners).
- owners: which advertiser owns each ad, checked and recorded where the ad's events are appended.
- consumer.ShardConsumer: per replica; XREAD its shard's stream from the last applied id, apply each read
  atomically, dead-letter poison entries, recover from snapshots, sweep expired ads, trim behind
  snapshots, report health (alive, caught_up, lag, errors, uncovered gaps, a stream it cannot read).
- snapshots.SnapshotStore: snapshot files named by the stream id they cover (one directory per shard).
- clients.redis_client: the service's Redis clients, each waiting a bounded time per connection or reply and
  retrying nothing itself (the publisher's, the rate limiter's and the consumer's tries are the only ones).
- local_redis.LocalRedis: a private redis-server for tests, benchmarks and `andromeda up`.
"""
