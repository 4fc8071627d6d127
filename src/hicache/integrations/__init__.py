"""Adapters that plug hicache into a serving engine's own extension points.

- hicache.integrations.vllm: ``HiCacheConnector``, a vLLM v1 KV connector (host and storage
  tiers behind vLLM's own prefix cache). Importing it imports vLLM; nothing else in hicache
  does (an import-linter contract keeps it so).
"""
