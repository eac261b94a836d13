"""How big and how many: an object-store transfer's part size and the number of its requests in flight.

They are s3fs's own knobs for the same trade-off: ``part_size`` is ``fs.default_block_size`` (s3fs: 50 MiB; the
``default_block_size`` storage option, never below S3's smallest non-final part) and the concurrency
``fs.max_concurrency`` (s3fs: 10; the ``max_concurrency`` option). Uploads cut their parts and downloads their ranges
by them.
"""

from __future__ import annotations

from typing import Any

_MIN_PART = 5 * 2**20  # S3's smallest non-final part


def part_size(fs: Any) -> int:
    return max(_MIN_PART, int(getattr(fs, "default_block_size", 0) or 50 * 2**20))


def concurrency(fs: Any) -> int:
    return max(1, int(getattr(fs, "max_concurrency", 1) or 1))
