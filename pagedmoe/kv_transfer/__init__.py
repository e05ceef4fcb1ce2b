"""KV cache events for KV-aware routers (and, to come, KV connectors between instances)."""
