"""Object-store transfers for large immutable files: uploads fed while the bytes are produced,
CRC32ed once, in parallel parts; downloads in parallel ranges, verified while they arrive.

Why not ``fs.pipe_file`` / ``fs.cat_file``: they need the whole content first and hash nothing.
Here (S3 through s3fs's own retrying call path, reached through ``storage/_compat.py``):

* ``open_upload`` gives a write-only file for ``torch.save`` whose checksum is the file's CRC32
  (``hexdigest()``), computed once and sent with the requests: botocore would otherwise CRC32 every
  request body itself, so the store verifies what we serialized and nothing is checksummed twice.
  Below ``2 * part_size`` nothing is sent until ``finish``, which CRC32s the bytes and sends one
  PUT (as s3fs's pipe would) carrying ``ChecksumCRC32``. From ``2 * part_size`` on it starts a
  multipart upload and sends each full part at once, up to ``fs.max_concurrency`` parts in flight
  on fsspec's event loop, while ``torch.save`` keeps producing the next ones (back-pressure bounds
  memory to ``max_concurrency + 2`` parts). Each part's CRC32 runs on a worker thread of that loop
  (``zlib`` releases the GIL) and goes with its ``UploadPart``; the file's CRC32 is combined from
  the parts' (``crc32_combine``), so the thread producing the bytes hashes nothing at all.
  ``finish`` completes the upload: the object appears whole or not at all. ``abort`` (and any
  error) aborts it, so no part is left billed; a killed process leaves an incomplete upload,
  invisible (a lifecycle rule reclaims it).
* ``fetch_verified`` downloads ``[0, size)`` in ``part_size`` ranges (``fs.max_concurrency`` at a
  time, no HEAD: the caller knows the size) straight into one preallocated buffer, while the
  calling thread checksums (CRC32 or sha256, as the caller asks) each range's arrived prefix in
  order. A size mismatch is seen from the first response's ``Content-Length``/``Content-Range``,
  before reading the body.

``part_size`` is ``fs.default_block_size`` (s3fs: 50 MiB; the ``default_block_size`` storage
option) and the concurrency ``fs.max_concurrency`` (s3fs: 10; the ``max_concurrency`` option): the
knobs s3fs already has for the same trade-off. Other filesystems get the same interface over a
memory buffer and one ``write_bytes_atomic`` / ``read_bytes``.

Files:

* ``sizes.py``: How big and how many: the part size and the number of requests in flight, s3fs's own knobs.
* ``upload.py``: Uploads: `open_upload`'s write-only file, one PUT below two parts, else a multipart upload fed
  while the bytes are produced, each request under its write deadline.
* ``download.py``: Downloads: `fetch_verified`'s concurrent ranged GETs into one buffer, checksummed in order as
  they arrive, and `reader`, a file over that buffer for ``torch.load``.
"""

from raytrain_events.storage.objectstore.download import fetch_verified, reader
from raytrain_events.storage.objectstore.sizes import concurrency, part_size
from raytrain_events.storage.objectstore.upload import ObjectUpload, open_upload

__all__ = ["ObjectUpload", "concurrency", "fetch_verified", "open_upload", "part_size", "reader"]
