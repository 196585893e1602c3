"""Real-time index updates through one Redis stream.

- records: the stream entry format (validated event + compiled targeting + ad-tower embedding).
- publisher.Publisher: validate, compile, embed, XADD (one transaction per batch, retried).
- consumer.ShardConsumer: per replica; XREAD from the last applied id, apply its shard atomically,
  dead-letter poison entries, recover from snapshots, sweep expired ads, trim behind snapshots.
- snapshots.SnapshotStore: snapshot files named by the stream id they cover.
- local_redis.LocalRedis: a private redis-server for tests, benchmarks and `andromeda up`.
"""
