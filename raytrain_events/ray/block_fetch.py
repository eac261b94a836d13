"""A rank's rows of a chunk of batches, each block's rows cut on the node that holds the block.

Why: Ray moves whole objects between nodes, and a node pulls a block once however many of its
ranks ask. With rows of a few KiB every node has a rank with a row in nearly every block, so a
rank that ``ray.get``s whole blocks makes every block cross the network once per node (about
N x the dataset on N nodes). Here a block on another node is not pulled: a small Ray task runs
on the block's node (`cut_rows`, soft node affinity to where the block is) and returns only the
rows this rank trains from it in the chunk, so each row crosses the network once, to the rank
that trains it (about (N - 1) / N x the dataset when blocks are spread over N nodes).

Per chunk of batches (up to 16 per feeder call) a rank makes one location lookup (an RPC to the
blocks' owner, the feeder) and one `cut_rows` task per block of the chunk held on another node,
covering all the rows it needs from that block in the chunk. A block already on the rank's node
(or without a node: a small block inlined in its owner) is a plain ``ray.get``, and rows are
listed only for the blocks cut; on a one-node cluster (``here`` is None) a chunk is one
``ray.get`` of its blocks and nothing else, as before.

`cut_rows` asks for no CPU (``num_cpus=0``): it never waits behind train workers, and never holds a
fraction of a CPU that a Ray Data read task (one whole CPU) would then not find. Its result is
small (a rank's rows); under 100 KiB Ray returns it inline to the caller, the rank.

`chunk_refs`, `split_by_node` and `needed_rows` are pure (no Ray): ``bench/data_network.py`` drives them with fake
blocks and node placements to count network bytes at 8 x 8 and 64 x 8 ranks.
"""

from __future__ import annotations

from typing import Any, Container, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "chunk_refs",
    "needed_rows",
    "split_by_node",
    "start_fetch",
    "finish_fetch",
    "fetch_blocks",
    "cut_rows",
    "local_rows",
    "cluster_node",
]

Rows = np.ndarray  # sorted, unique row numbers within one block (int64)
Fetched = Dict[Any, Tuple[Any, Optional[Rows]]]  # ref -> (block or its cut rows, which rows: None = all)
Started = Tuple[List[Any], List[Tuple[Any, Rows, Any]]]  # blocks got whole; (ref, rows, cut task) of the others


def chunk_refs(served: Sequence[Optional[Sequence[Any]]]) -> List[Any]:
    """The blocks a chunk's batches read, each once, in the order they first appear."""
    refs: Dict[Any, None] = {}
    for slices in served:
        if slices is None:
            break
        for piece in slices:
            if len(piece) == 3:
                refs[piece[0]] = None
            else:
                refs.update(dict.fromkeys(piece[1]))
    return list(refs)


def needed_rows(served: Sequence[Optional[Sequence[Any]]], only: Optional[Container[Any]] = None) -> Dict[Any, Rows]:
    """Each block's rows that a chunk's batches read (slices ``(ref, lo, hi)`` or shuffle takes
    ``(TAKE, refs, which, rows)``), sorted and unique; only for the blocks in ``only`` if given."""
    parts: Dict[Any, List[np.ndarray]] = {}
    for slices in served:
        if slices is None:
            break
        for piece in slices:
            if len(piece) == 3:
                ref, lo, hi = piece
                if only is None or ref in only:
                    parts.setdefault(ref, []).append(np.arange(lo, hi, dtype=np.int64))
            else:
                _, refs, which, rows = piece
                for j, ref in enumerate(refs):
                    if only is None or ref in only:
                        parts.setdefault(ref, []).append(np.asarray(rows, dtype=np.int64)[np.asarray(which) == j])
    return {ref: np.unique(np.concatenate(chunks)) for ref, chunks in parts.items()}


def split_by_node(
    refs: Sequence[Any], here: Optional[Hashable], locations: Mapping[Any, Sequence[Hashable]]
) -> Tuple[List[Any], Dict[Any, Hashable]]:
    """Which blocks to get whole (on node ``here``, or on no node) and which to cut where they are.

    ``locations``: the nodes holding a copy of each block (a block missing from it, or on no node --
    a small block inlined in its owner -- is fetched whole). ``here`` None (a one-node cluster):
    every block whole. Returns the whole blocks and, for the others, ``ref -> node to cut on``.
    """
    whole: List[Any] = []
    cut: Dict[Any, Hashable] = {}
    for ref in refs:
        nodes = locations.get(ref) or ()
        if here is None or not nodes or here in nodes:
            whole.append(ref)
        else:
            cut[ref] = nodes[0]
    return whole, cut


def local_rows(rows: Optional[Rows], wanted: Any) -> Any:
    """Where rows ``wanted`` of a block are in what was fetched of it (``rows`` of it; None: all)."""
    if rows is None:
        return wanted
    return np.searchsorted(rows, wanted)


def cut_rows(block: Any, rows: Rows) -> Any:
    """Rows ``rows`` of ``block`` as a new block (run as a Ray task on the block's node)."""
    from ray.data.block import BlockAccessor

    accessor = BlockAccessor.for_block(block)
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo == len(rows):  # one contiguous range: a slice, copied so only these rows are sent
        return accessor.slice(lo, hi, copy=True)
    return accessor.take(rows)


_cut_task: Any = None
_LOOKUP_TIMEOUT_MS = 60_000  # a location lookup that takes longer falls back to whole blocks


def _remote_cut() -> Any:
    global _cut_task
    if _cut_task is None:
        import ray

        _cut_task = ray.remote(num_cpus=0, max_retries=3)(cut_rows)
    return _cut_task


def cluster_node() -> Optional[str]:
    """This worker's node id when the cluster has several nodes (blocks may be elsewhere), else None."""
    import ray

    if sum(1 for node in ray.nodes() if node.get("Alive")) <= 1:
        return None
    return ray.get_runtime_context().get_node_id()


def start_fetch(served: Sequence[Optional[Sequence[Any]]], here: Optional[str]) -> Started:
    """Start fetching a chunk's blocks: the cut tasks are submitted now, `finish_fetch` waits for them
    (so a rank can start the next chunk's tasks while it trains this one)."""
    refs = chunk_refs(served)
    if here is None or not refs:
        return refs, []
    import ray
    from ray.experimental import get_object_locations
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        found = get_object_locations(refs, timeout_ms=_LOOKUP_TIMEOUT_MS)
    except ray.exceptions.GetTimeoutError:
        found = {}  # the owner does not answer: plain gets, which raise if the blocks are gone
    whole, cut = split_by_node(refs, here, {ref: found.get(ref, {}).get("node_ids") or () for ref in refs})
    needed = needed_rows(served, cut)
    task = _remote_cut()
    pending = [
        (
            ref,
            needed[ref],
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote(ref, needed[ref]),
        )
        for ref, node in cut.items()
    ]
    return whole, pending


def finish_fetch(started: Started) -> Fetched:
    """The blocks (whole, or this rank's rows of them) of a chunk whose fetch `start_fetch` started."""
    import ray

    whole, pending = started
    out: Fetched = {ref: (block, None) for ref, block in zip(whole, ray.get(whole))}
    for (ref, rows, _), part in zip(pending, ray.get([task for _, _, task in pending])):
        out[ref] = (part, rows)
    return out


def fetch_blocks(served: Sequence[Optional[Sequence[Any]]], here: Optional[str]) -> Fetched:
    """The blocks (whole, or this rank's rows of them) that a chunk's batches read (see module doc)."""
    return finish_fetch(start_fetch(served, here))
