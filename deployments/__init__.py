"""Ray Serve application: FastAPI ingress, router and index-shard replicas (see the serving issue)."""
