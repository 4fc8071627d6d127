"""Adapters that plug hicache into a serving engine's own extension points (one module per engine)."""
