"""A rank's rows of a chunk of batches, each block's rows cut on the node that holds the block.

Why: Ray moves whole objects between nodes, and a node pulls a block once however many of its
ranks ask. With rows of a few KiB every node has a rank with a row in nearly every block, so a
rank that ``ray.get``s whole blocks makes every block cross the network once per node (about
N x the dataset on N nodes). Here a block on another node is not pulled: a small Ray task runs
on the block's node (`cut_rows`, soft node affinity to where the block is) and returns only the
rows this rank trains from it in the chunk, so each row crosses the network once, to the rank
that trains it (about (N - 1) / N x the dataset when blocks are spread over N nodes).

Per chunk of batches (up to 16 per feeder call) a rank makes one location lookup (an RPC to the
blocks' owner, the feeder) and one call per other node holding blocks of the chunk (`BlockCutter.cut_many`,
`cut_rows` of each of that node's blocks: all the rows the rank needs from each block in the chunk),
whatever the number of blocks there (a mixture's chunk reads a block of each source: one call per
block cost it about three times a single source's round trips). A block already on the rank's node
(or without a node: a small block inlined in its owner) is a plain ``ray.get``, and rows are
listed only for the blocks cut; on a one-node cluster (``here`` is None) a chunk is one
``ray.get`` of its blocks and nothing else, as before.

The cuts run in one `BlockCutter` actor per node (named after the node, made there by the first rank that
needs it, shared by every rank of the job; a thread pool of `CUTTER_THREADS`), so a node runs one
extra process for them however many ranks cut there -- Ray tasks asking for no CPU would each get
a worker process of their own, up to one per concurrent cut (hundreds per node at 512 ranks). The
actor asks for no CPU (``num_cpus=0``): it never waits behind train workers, and never holds a
fraction of a CPU that a Ray Data read task (one whole CPU) would then not find. It lives as long
as the rank that made it; a cut whose actor died (that rank's group ended) falls back to getting
that block whole, and the next chunk makes a new actor. Its results are small (a rank's rows);
under 100 KiB Ray returns them inline to the caller, the rank.

`chunk_refs`, `split_by_node` and `needed_rows` are pure (no Ray): ``bench/data_network.py`` drives them with fake
blocks and node placements to count network bytes at 8 x 8 and 64 x 8 ranks.
"""

from __future__ import annotations

from typing import Any, Container, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from raytrain_events.data.ray.slices import Slice

__all__ = [
    "chunk_refs",
    "needed_rows",
    "split_by_node",
    "start_fetch",
    "finish_fetch",
    "fetch_blocks",
    "cut_rows",
    "BlockCutter",
    "CUTTER_THREADS",
    "local_rows",
    "cluster_node",
    "CutterStarter",
]

Rows = np.ndarray  # sorted, unique row numbers within one block (int64)
Fetched = Dict[Any, Tuple[Any, Optional[Rows]]]  # ref -> (block or its cut rows, which rows: None = all)
# The blocks got whole; one (refs, their rows, node, call) per node whose blocks are cut there.
Started = Tuple[List[Any], List[Tuple[List[Any], List[Rows], str, Any]]]


def chunk_refs(served: Sequence[Optional[Sequence[Slice]]]) -> List[Any]:
    """The blocks a chunk's batches read, each once, in the order they first appear."""
    refs: Dict[Any, None] = {}
    for slices in served:
        if slices is None:
            break
        for piece in slices:
            refs.update(dict.fromkeys(piece.blocks()))
    return list(refs)


def needed_rows(served: Sequence[Optional[Sequence[Slice]]], only: Optional[Container[Any]] = None) -> Dict[Any, Rows]:
    """Each block's rows that a chunk's batches read (its `RowRange` and `Take` slices), sorted and
    unique; only for the blocks in ``only`` if given."""
    parts: Dict[Any, List[np.ndarray]] = {}
    for slices in served:
        if slices is None:
            break
        for piece in slices:
            for ref, rows in piece.block_rows():
                if only is None or ref in only:
                    parts.setdefault(ref, []).append(rows)
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


CUTTER_THREADS = 8  # cuts one node's `BlockCutter` runs at once (numpy/Arrow copies, mostly outside the GIL)
CUTTER_NAME = "raytrain-block-cutter-{node}"
_LOOKUP_TIMEOUT_MS = 60_000  # a location lookup that takes longer falls back to whole blocks


class BlockCutter:
    """Cuts rows out of blocks held on its node for every rank that asks (one actor per node)."""

    def cut_many(self, rows: List[Rows], *blocks: Any) -> List[Any]:
        """`cut_rows` of each block (Ray resolves the block refs, all held on this node) in one call."""
        return [cut_rows(block, wanted) for block, wanted in zip(blocks, rows, strict=True)]


_cutter_class: Any = None
_cutters: Dict[str, Any] = {}  # node id -> this process's handle to that node's cutter


def _cutter(node: str) -> Any:
    """The `BlockCutter` of ``node``: found by name, or made there if none is alive.

    Hard node affinity: with a soft one, Ray placed a cutter made from a rank's worker on that rank's
    node rather than the (busy) node holding the blocks, which then pulled every block there (2.35x
    the dataset in ``test_data_network.py``). A node gone since the location lookup fails the cut,
    and that block is fetched whole instead (`finish_fetch`)."""
    global _cutter_class
    handle = _cutters.get(node)
    if handle is None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if _cutter_class is None:
            _cutter_class = ray.remote(BlockCutter)
        handle = _cutter_class.options(
            name=CUTTER_NAME.format(node=node),
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=CUTTER_THREADS,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote()
        _cutters[node] = handle
    return handle


def cluster_node() -> Optional[str]:
    """This worker's node id when the cluster has several nodes (blocks may be elsewhere), else None."""
    import ray

    if sum(1 for node in ray.nodes() if node.get("Alive")) <= 1:
        return None
    return ray.get_runtime_context().get_node_id()


class CutterStarter:
    """Starts the `BlockCutter` of each node that the first blocks of a stream are on, before a rank needs it.

    The feeder's pull thread calls it with each bundle's block refs (the first `STARTER_BUNDLES` of
    each epoch's stream): a cutter's start (a new actor process, most of a second) then overlaps the
    worker group's start (the driver starts the stream first) instead of delaying every rank's first
    batch, which cuts there. Nothing on a one-node cluster (ranks never cut there). Best effort: a
    failed lookup or start leaves it to the rank, as before. Cost: one location lookup (the feeder owns
    the blocks: no remote call) per bundle for the first `STARTER_BUNDLES` bundles of an epoch.
    """

    def __init__(self) -> None:
        self.left = STARTER_BUNDLES
        self.several: Optional[bool] = None  # the cluster has several nodes (asked once)
        self.started: set = set()

    def __call__(self, refs: Sequence[Any]) -> None:
        if self.left <= 0 or not refs:
            return
        self.left -= 1
        try:
            if self.several is None:
                self.several = cluster_node() is not None
            if not self.several:
                self.left = 0
                return
            from ray.experimental import get_object_locations

            found = get_object_locations(list(refs), timeout_ms=5_000)
            for ref in refs:
                for node in found.get(ref, {}).get("node_ids") or ():
                    if node not in self.started:
                        self.started.add(node)
                        _cutter(node)  # created in the background (named: the ranks find it)
        except Exception:  # noqa: BLE001 - an optimization only: the rank starts the cutter itself
            self.left = 0


STARTER_BUNDLES = 32  # bundles of an epoch's stream whose nodes get a cutter started by the feeder


def start_fetch(served: Sequence[Optional[Sequence[Slice]]], here: Optional[str]) -> Started:
    """Start fetching a chunk's blocks: the cut tasks are submitted now, `finish_fetch` waits for them
    (so a rank can start the next chunk's tasks while it trains this one)."""
    refs = chunk_refs(served)
    if here is None or not refs:
        return refs, []
    import ray
    from ray.experimental import get_object_locations

    try:
        found = get_object_locations(refs, timeout_ms=_LOOKUP_TIMEOUT_MS)
    except ray.exceptions.GetTimeoutError:
        found = {}  # the owner does not answer: plain gets, which raise if the blocks are gone
    whole, cut = split_by_node(refs, here, {ref: found.get(ref, {}).get("node_ids") or () for ref in refs})
    needed = needed_rows(served, cut)
    by_node: Dict[str, List[Any]] = {}
    for ref, node in cut.items():
        by_node.setdefault(node, []).append(ref)
    pending = []
    for node, refs_there in by_node.items():
        rows = [needed[ref] for ref in refs_there]
        pending.append((refs_there, rows, node, _cutter(node).cut_many.remote(rows, *refs_there)))
    return whole, pending


def finish_fetch(started: Started) -> Fetched:
    """The blocks (whole, or this rank's rows of them) of a chunk whose fetch `start_fetch` started."""
    import ray

    whole, pending = started
    out: Fetched = {ref: (block, None) for ref, block in zip(whole, ray.get(whole))}
    try:
        parts = ray.get([task for *_, task in pending])
    except _cutter_gone():  # a cutter died with the rank that made it, or its node went: those blocks whole
        parts = [_cut_or_none(task) for *_, task in pending]
    for (refs, rows, node, _), cut in zip(pending, parts):
        if cut is None:
            _cutters.pop(node, None)  # the next chunk finds or makes that node's new cutter
            out.update((ref, (block, None)) for ref, block in zip(refs, ray.get(refs)))
        else:
            out.update((ref, (part, wanted)) for ref, part, wanted in zip(refs, cut, rows))
    return out


def _cutter_gone() -> Tuple[type, ...]:
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)


def _cut_or_none(task: Any) -> Any:
    import ray

    try:
        return ray.get(task)
    except _cutter_gone():
        return None


def fetch_blocks(served: Sequence[Optional[Sequence[Slice]]], here: Optional[str]) -> Fetched:
    """The blocks (whole, or this rank's rows of them) that a chunk's batches read (see module doc)."""
    return finish_fetch(start_fetch(served, here))
