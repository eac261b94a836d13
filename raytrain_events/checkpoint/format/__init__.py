"""On-storage checkpoint format: one new directory per checkpoint, committed by its manifest.

Layout (any fsspec URL: local path, ``memory://``, ``s3://``...), multi-file (format_version 4;
1 is still read)::

    <root>/ckpt-<batch:012d>-<uuid8>/      sortable by name; never overwritten
        state.pt, rng-rank0.pt, ...        torch.save bytes, each uploaded atomically
        manifest.json                      written LAST, create-only: its presence = committed

or packed (format_version 3, ``packed.py``; 2 is still read): the directory holds only ``manifest.json``, whose
first line is the manifest and the rest the files' bytes, written by ONE create-only request
(``write_packed_checkpoint``). ``write_checkpoint`` packs small checkpoints held by one process
on object stores (``packed.should_pack``): a save is then one PUT and a load one GET instead
of two sequential requests each. Readers take both layouts; the manifest model and its parsing
live in ``manifest.py``.

Why: a reader that sees ``manifest.json`` sees every payload file complete, and a crash at
any point before it leaves only an uncommitted directory that ``list_checkpoints`` ignores,
so the previous checkpoint stays ``latest`` and loadable. The manifest records
``format_version`` (``FORMAT_VERSION``), the library version, creation time, the caller's
``timestamp`` dict (plain ints), ``world_size``, free-form JSON ``metadata`` and, per file,
its name, size and checksum (detects truncation and bit rot): CRC32 (``packed.py`` says why
that is enough; versions 1 and 2, still read, recorded sha256s, and are still written, as 1,
when every ``FileEntry`` a caller commits carries a sha256).

Why ``torch.save`` + ``torch.load(weights_only=True)`` and not torch.distributed.checkpoint:
DCP reads its ``.metadata`` with plain ``pickle`` (code execution on load), and for DDP the
replicated state is written once by rank 0 anyway. Safety comes from ``weights_only``, NOT
from the checksums: whoever can write a payload can rewrite the manifest too.

Several ranks: rank 0 picks the URL (``new_checkpoint_url``) and broadcasts it; every rank r
uploads its own ``rng_file_name(r)`` with ``write_checkpoint_file`` and sends the returned
``FileEntry`` to rank 0, which uploads its files and calls ``commit_checkpoint`` with all
entries. ``write_checkpoint`` does all of that for one process.

Code: ``writer.py`` writes and commits, ``reader.py`` reads and verifies. Nothing is re-exported
here: import each name from the module that defines it (the public ones also from
``raytrain_events.checkpoint``). This subpackage imports no other part of ``checkpoint/``.

I/O paths (the bytes on storage are the same either way; our ``torch.save`` calls skip torch's
zip CRC32, ``checksums.torch_zip_crc_off``, as ours covers the bytes):

* Save, local: ``torch.save`` streams into the temp file, CRC32ed on the way, then fsync +
  rename (``local_atomic_writer``). Object stores: ``torch.save`` streams into
  ``storage.objectstore.open_upload``: below two parts one PUT carrying the CRC32; above, a
  multipart upload whose parts go up in parallel with their CRC32s, completed (or aborted)
  before the manifest.
* Load, local files >= 1 MiB on POSIX: size check, checksum over an ``mmap``, then
  ``torch.load(path, mmap=True)``: no read copy; tensors are copy-on-write (``MAP_PRIVATE``)
  views of the page cache, copied when ``load_state_dict`` copies from them or written to.
  Sound because checkpoint files are never rewritten in place (temp file + rename, a new
  directory per checkpoint), and deleting a mapped file (pruning) leaves the mapping valid on
  POSIX. Windows cannot delete a mapped file, so there (and for small files) the file is read
  into memory, as on object stores. Caveat: on a network filesystem a deletion by ANOTHER host
  can make not-yet-read pages unreadable; the Trainer copies weights out at once and the first
  step rewrites optimizer state, so only state a run never touches stays mapped.
* Load, packed: one plain GET of ``manifest.json`` (no HEAD), the length and each file's
  checksum checked, ``torch.load`` from views of that buffer (no copy). A listing reads the
  first ``packed.HEAD_BYTES`` of each manifest (one ranged GET each, concurrent).
* Load, object stores: ``storage.objectstore.fetch_verified``: no HEAD, concurrent ranged GETs
  into one buffer that ``torch.load`` reads without a copy, checksummed in order as ranges
  arrive; a wrong size is seen from the first response's headers.

Files:

* ``checksums.py``: Checksums of checkpoint files: the hashing thread, torch's zip CRC switched off
  (CRC arithmetic: storage/crc32.py).
* ``local_copy.py``: One checkpoint's node-local copy: its files written beside the upload (same
  pass), and read only where they match the committed manifest.
* ``manifest.py``: The manifest of a checkpoint: its data model, parsing (both layouts) and input
  checks.
* ``packed.py``: Packed checkpoints: the manifest and every payload file in ONE object, written
  with ONE request.
* ``reader.py``: Reading one committed checkpoint: its manifest, then its files, verified and
  ``weights_only``-loaded.
* ``safety.py``: The torch floor that our "safe to load" promise rests on, checked before any
  checkpoint load.
* ``writer.py``: Writing one checkpoint: payload files uploaded atomically, then the manifest that
  commits them.
"""
