"""CRC32 (zlib's CRC-32, the one zip, gzip and S3's ``ChecksumCRC32`` use) for checkpoint files.

* ``Crc32``: an incremental checksum with hashlib's ``update``/``hexdigest`` interface, so the
  streamed writers (local temp file, object-store upload) and readers take it where they took
  ``hashlib.sha256()``. ``zlib.crc32`` releases the GIL on big buffers and runs ~2x faster
  than sha256 here (16 MiB: 4.9 ms vs 10.8 ms).
* ``crc32_combine``: the CRC32 of ``A + B`` from the CRC32s of ``A`` and ``B`` and ``len(B)``
  (zlib's ``crc32_combine``, which Python's ``zlib`` does not expose; ~50 us in Python). Parts
  checksummed separately (a multipart upload's parts, a packed object's files) give the whole
  file's CRC32 without another pass.
* ``new_checksum``: the one place that maps a manifest's algorithm name ("crc32", or "sha256"
  of older checkpoints) to a checksum object.
* ``s3_checksum``: how S3 wants it in ``ChecksumCRC32`` (base64 of the 4 big-endian bytes).
  A request that carries it is verified by the object store, and botocore then does not
  compute its own CRC32 over the body again.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from typing import Any

_POLY = 0xEDB88320  # CRC32, bit-reflected


def crc32_hex(value: int) -> str:
    """How a manifest records a CRC32: 8 lowercase hex digits."""
    return f"{value & 0xFFFFFFFF:08x}"


def s3_checksum(value: int) -> str:
    """``ChecksumCRC32`` of an S3 request: base64 of the CRC's 4 big-endian bytes."""
    return base64.b64encode((value & 0xFFFFFFFF).to_bytes(4, "big")).decode()


class Crc32:
    """Incremental CRC32 with hashlib's interface (``update``, ``hexdigest``) plus ``value``."""

    name = "crc32"

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return crc32_hex(self.value)


def new_checksum(algorithm: str) -> Any:
    """An incremental checksum object for ``algorithm``: "crc32" (``Crc32``) or "sha256" (hashlib)."""
    if algorithm == "crc32":
        return Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"Unknown checksum algorithm {algorithm!r}: expected 'crc32' or 'sha256'.")


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (bit-reflected), as in zlib's crc32.c."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^k) mod p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` given ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)``, ``len2 = len(b)``."""
    p, k, n = 1 << 31, 3, len2  # x^0; x^(8 * len2) = x^(len2 * 2^3)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2
