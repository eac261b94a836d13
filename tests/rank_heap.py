"""Imported last by the ranks' forkserver (`rank_processes.PRELOAD`): freezes what the preloaded imports built.

Every rank is a fork of that server and inherited its ~280,000 import-time objects (torch, ``torch._dynamo``,
the loop), which each full garbage collection in each rank walked again (~0.2 CPU-s each here: Python's own
collections and the loop's ``gc.collect()`` after an out-of-memory attempt), and whose headers it wrote, copying
the shared pages into the rank. ``gc.freeze`` keeps them out of the collector's generations (the documented use:
state built before forking); what a rank creates is collected as before.
"""

import gc

gc.collect()
gc.freeze()
