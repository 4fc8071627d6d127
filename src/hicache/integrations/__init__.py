"""Adapters that plug hicache into a serving engine's own extension points (one module per engine).

- hicache.integrations.vllm: ``HiCacheConnector``, a vLLM v1 KV connector (host and storage
  tiers behind vLLM's own prefix cache).
- hicache.integrations.sglang: ``HiCacheBackend``, an SGLang HiCache storage backend (L3) over
  hicache's stores and storage tier.

Importing one imports its engine; nothing else in hicache does (import-linter contracts keep it so).
"""
