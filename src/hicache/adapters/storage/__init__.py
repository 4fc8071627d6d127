"""Storage adapters: the L3 stores behind the storage port (hicache.domain.storage)."""
