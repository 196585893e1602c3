"""The Ray Serve application (the only package that touches HTTP and Ray).

- config.ServiceConfig: the one typed config; it builds the app and writes the Serve config YAML.
- app.build_app: config -> Application (router + one deployment per index shard).
- router.Router: FastAPI ingress; user towers once per request, scatter to every shard, exact merge.
- shard.ShardReplica: one copy of one shard: device-resident AdIndex, batched search, stream consumer.
- api: HTTP models, write-token auth, errors -> status codes. metrics: Prometheus metrics.
- limits: input limits, per-router token buckets, the latency shedder and the write path's thread lane (writes'
  Redis calls off the retrievals' pool, bounded); shared_limits: the same buckets in Redis, for all routers.
"""
