"""The on-disk object format of DirectoryStore: one header, then the payload bytes.

- HEADER_SPAN: the bytes reserved for a header (the payload starts there, 512-byte aligned).
- encode_header: a key, a payload length and a checksum into the header bytes.
- Header / decode_header: the header fields back, or a CorruptObject saying what is wrong.
- CorruptObject: a header that is not ours, is damaged or names another key.

Layout (little-endian): magic "HCSTORE\\0", format version u16, checksum algorithm u16, header
length u32, payload length u64, payload checksum u64 (version 1: a u32 then a reserved u32 that
is ignored; version 2: all 64 bits), page hash (32 raw bytes),
namespace length u16, pool length u16, namespace, pool, zero padding, and in the last 4 bytes
of HEADER_SPAN the crc32 of everything before them (so any changed header byte is caught). Nothing is pickled: every field is a number or ASCII text.

Versions: objects with a 32-bit checksum (crc32, blocksum64) are written as version 1, exactly
as before; objects with a 64-bit checksum (xxh3, the default) as version 2, which a hicache that
reads only version 1 refuses (a miss) instead of misreading. Both versions are read here, each
checked by the algorithm its header names; an algorithm that does not fit the version (xxh3 in
version 1) is a CorruptObject.
"""

from __future__ import annotations

import struct
import zlib

import attrs

from hicache.adapters.storage.checksum import Checksum
from hicache.domain.storage import StoreKey

MAGIC = b"HCSTORE\0"
VERSION = 2  # the newest version written (64-bit checksums); 1 is read too
VERSIONS = (1, 2)
HEADER_SPAN = 512
_FIXED = struct.Struct("<8sHHIQQ32sHH")
_CRC = struct.Struct("<I")


class CorruptObject(Exception):
    """A stored object that cannot be trusted (internal to the store: it becomes a MISS)."""


@attrs.frozen
class Header:
    checksum: Checksum
    payload_len: int
    payload_crc: int
    namespace: str
    pool: str
    page_hash: str


def encode_header(key: StoreKey, payload_len: int, checksum: Checksum, payload_crc: int) -> bytes:
    ns, pool = key.namespace.encode("ascii"), key.pool.encode("ascii")
    body = (
        _FIXED.pack(
            MAGIC,
            2 if checksum.digest_bits == 64 else 1,
            checksum.value,
            HEADER_SPAN,
            payload_len,
            payload_crc & ((1 << checksum.digest_bits) - 1),
            bytes.fromhex(key.page_hash),
            len(ns),
            len(pool),
        )
        + ns
        + pool
    )
    body += bytes(HEADER_SPAN - _CRC.size - len(body))
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(data: bytes) -> Header:
    """The header at the start of ``data`` (at least HEADER_SPAN bytes), checked."""
    if len(data) < HEADER_SPAN:
        raise CorruptObject(f"object of {len(data)} B is shorter than its {HEADER_SPAN} B header")
    magic, version, algo, span, payload_len, payload_crc, digest, ns_len, pool_len = (
        _FIXED.unpack_from(data)
    )
    if magic != MAGIC:
        raise CorruptObject(f"bad magic {magic!r}")
    if version not in VERSIONS:
        raise CorruptObject(f"format version {version}, this hicache reads {VERSIONS}")
    (stored_crc,) = _CRC.unpack_from(data, HEADER_SPAN - _CRC.size)
    if zlib.crc32(data[: HEADER_SPAN - _CRC.size]) != stored_crc:
        raise CorruptObject("header checksum mismatch")
    end = _FIXED.size + ns_len + pool_len
    if span != HEADER_SPAN or end + _CRC.size > HEADER_SPAN:
        raise CorruptObject(f"header length {span} / strings {ns_len}+{pool_len} out of range")
    try:
        checksum = Checksum(algo)
        if (checksum.digest_bits == 64) != (version == 2):
            raise ValueError(f"checksum {checksum.name.lower()} in a version {version} header")
        if version == 1:
            payload_crc &= 0xFFFFFFFF  # version 1: the upper half was a reserved field
        namespace = data[_FIXED.size : _FIXED.size + ns_len].decode("ascii")
        pool = data[_FIXED.size + ns_len : end].decode("ascii")
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptObject(f"unreadable header field: {e}") from None
    return Header(checksum, payload_len, payload_crc, namespace, pool, digest.hex())


def check_key(header: Header, key: StoreKey) -> None:
    """Raise CorruptObject when ``header`` belongs to another key than ``key``."""
    if (header.namespace, header.pool, header.page_hash) != (
        key.namespace,
        key.pool,
        key.page_hash,
    ):
        raise CorruptObject(
            f"object holds {header.namespace}/{header.pool}/{header.page_hash}, not {key}"
        )
