"""Checksums of checkpoint files: the hashing thread, torch's zip CRC switched off (CRC arithmetic: storage/crc32.py).

* ``crc32_combine`` (from ``storage/crc32.py``, where the CRC arithmetic lives): a packed
  checkpoint (``packed.py``) checksums each file while ``torch.save`` produces it; with it,
  the checksum of the whole object (header line + files) follows without a second pass, and
  goes with the PUT (``ChecksumCRC32``), so the object store verifies the bytes we serialized
  and botocore does not compute its own CRC32 over the body again.
* ``checksum_meanwhile``: start a file's checksum on the one hashing thread (``zlib.crc32``
  and ``hashlib.sha256`` release the GIL on big buffers), so a load verifies while
  ``torch.load`` reads.
* ``torch_zip_crc_off``: ``torch.save`` writes a zip whose records carry a CRC32 that
  ``torch.load`` never checks (a flipped byte loads silently: measured with torch 2.13), so
  where our own checksum covers the bytes it is pure cost (16 MiB: 7.1 ms with it, 2.0 ms
  without). The switch is ``torch.utils.serialization.config.save.compute_crc32``, read when
  ``torch.save`` opens its zip writer. Torch 2.13 keeps such overrides per thread (its config
  module stores them in a ContextVar: checked once, ``_per_thread``), so the context manager
  sets and restores it for the calling thread only and another thread's concurrent
  ``torch.save`` is not affected at all. Where a torch keeps it process-global, the context
  manager counts its users under a lock: the first turns the CRC off, the last restores the
  value it found; another thread's ``torch.save`` that opens its writer inside that window then
  writes zero zip CRCs, which is harmless (``torch.load`` ignores them; only an external
  ``unzip -t`` would complain). Torch < 2.5 has no switch: there it does nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from raytrain_events.storage.crc32 import crc32_combine as crc32_combine  # re-exported
from raytrain_events.storage.crc32 import crc32_hex as crc32_hex  # re-exported
from raytrain_events.storage.crc32 import new_checksum

try:
    from torch.utils.serialization import config as _torch_config
except ImportError:  # torch < 2.5: no switch, torch.save always computes its CRC
    _torch_config = None

BATCH = 256 * 2**10  # measured: 1 MiB states pack 0.3 ms faster than with 1 MiB batches


def checksum(algorithm: str, data: Any) -> str:
    """Hex digest of ``data`` with ``algorithm`` ("crc32" or "sha256")."""
    digest = new_checksum(algorithm)
    digest.update(data)
    return str(digest.hexdigest())


def checksum_meanwhile(algorithm: str, data: Any) -> Callable[[], str]:
    """Start the checksum of ``data`` (on the hashing thread if big); call the result for the hex digest."""
    if memoryview(data).nbytes < BATCH:
        digest = checksum(algorithm, data)
        return lambda: digest
    return hasher().submit(checksum, algorithm, data).result


_HASHER: concurrent.futures.ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def hasher() -> concurrent.futures.ThreadPoolExecutor:
    """One hashing thread per process, started on first use (never at import); FIFO, so jobs
    that continue a running checksum run in order."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-ckpt-checksum")
        return _HASHER


_ZIP_CRC_LOCK = threading.Lock()
_zip_crc_users = 0
_zip_crc_before = True


@functools.cache
def _per_thread() -> bool:
    """Whether torch keeps ``compute_crc32`` overrides per thread (torch 2.13 does)."""
    assert _torch_config is not None
    seen: list[bool] = []
    with _ZIP_CRC_LOCK:
        before = _torch_config.save.compute_crc32
        _torch_config.save.compute_crc32 = not before
        try:
            probe = threading.Thread(target=lambda: seen.append(_torch_config.save.compute_crc32))
            probe.start()
            probe.join()
        finally:
            _torch_config.save.compute_crc32 = before
    return seen[0] == before  # the other thread did not see our override


@contextlib.contextmanager
def torch_zip_crc_off() -> Iterator[None]:
    """``torch.save`` inside skips its zip CRC32 (see the module docstring); the previous
    setting is back afterwards, also when the save failed."""
    global _zip_crc_users, _zip_crc_before
    if _torch_config is None:
        yield
        return
    if _per_thread():
        before = _torch_config.save.compute_crc32
        _torch_config.save.compute_crc32 = False
        try:
            yield
        finally:
            _torch_config.save.compute_crc32 = before
        return
    with _ZIP_CRC_LOCK:
        if _zip_crc_users == 0:
            _zip_crc_before = _torch_config.save.compute_crc32
            _torch_config.save.compute_crc32 = False
        _zip_crc_users += 1
    try:
        yield
    finally:
        with _ZIP_CRC_LOCK:
            _zip_crc_users -= 1
            if _zip_crc_users == 0:
                _torch_config.save.compute_crc32 = _zip_crc_before
