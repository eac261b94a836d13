"""Worker guards: what keeps a long Ray run healthy on each worker, set up before its `Trainer`.

``operations.py`` installs them: the start-up health check (``health.py``: every rank meets once,
within a deadline), the progress watchdog (``watchdog.py``: a hung rank found, its stack saved, the
group restarted) and preemption handling (``preemption.py``: a SIGTERM or a notice becomes a
committed checkpoint).

Files:

* ``health.py``: The start-up health check: every rank meets once, within a deadline, before
  training.
* ``operations.py``: What keeps a long Ray run operating itself, set up on each worker before its
  `Trainer`.
* ``preemption.py``: Preemption on a Ray worker: a SIGTERM or a notice becomes a committed
  checkpoint at the next batch.
* ``watchdog.py``: The progress watchdog: a hung rank is found, its stack saved and named, and the
  group restarted.
"""
