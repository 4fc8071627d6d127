"""Storage (L3) adapters behind the Store port of hicache.domain.storage.

- DirectoryStore / DirectorySettings: the embedded default, one checked file per page object.
- Checksum: the payload checksums a DirectoryStore file may use.
- page_buffer: the PageBuffer (memoryview segments) of one page of one host pool.
- MooncakeStore (adapters.storage.mooncake, imported on demand): Mooncake Store as the L3 tier.
"""

from hicache.adapters.storage.checksum import Checksum
from hicache.adapters.storage.directory import DirectoryStore, object_name
from hicache.adapters.storage.directory_settings import DirectorySettings
from hicache.adapters.storage.page_buffers import HostGroupBuffers, page_buffer

__all__ = [
    "Checksum",
    "DirectorySettings",
    "DirectoryStore",
    "HostGroupBuffers",
    "object_name",
    "page_buffer",
]
