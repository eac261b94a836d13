"""Sharded checkpoints: each rank writes and reads its own shards through torch.distributed.checkpoint.

DCP as the project uses it: made safe to load (a restricted unpickler for its metadata, no
``weights_only=False``), hashed as it writes, read with ranged GETs on a reshard, and converted to
or from a Hugging Face-style safetensors directory. Built on ``format/`` (the manifest that commits
a sharded checkpoint, its checksums, the torch floor) and on ``host.py`` (what the loop gives).

Files:

* ``item_stream.py``: A read-only stream over the saved items of one DCP file that fetches each
  item once, exactly.
* ``ranged_dcp.py``: Read only the bytes a rank needs of each saved DCP tensor item (ranged reads
  on a reshard).
* ``safe_dcp.py``: torch.distributed.checkpoint (DCP) made safe to load, and writing that hashes as
  it goes.
* ``safetensors_io.py``: Safetensors out and in: a checkpoint's model as a Hugging Face-style
  safetensors directory, and such a directory loaded into a (sharded) model.
* ``sharded.py``: Sharded checkpoints: each rank writes its own shards with
  torch.distributed.checkpoint (DCP).
"""
