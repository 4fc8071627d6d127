"""The composition root: the only code that names concrete adapters and reads config files.

- config: extra config (JSON / @file), model configs (path or bundled name) into domain values.
"""

from hicache.bootstrap.config import (
    bundled_models,
    load_extra_config,
    load_model_config,
    load_model_spec,
    storage_settings,
)

__all__ = [
    "bundled_models",
    "load_extra_config",
    "load_model_config",
    "load_model_spec",
    "storage_settings",
]
