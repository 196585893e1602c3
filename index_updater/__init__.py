"""Real-time index updates: event publisher, Redis stream consumer and snapshots (see issue 4)."""
