"""Reports and history of a Ray run: from each worker's counts to the driver's console and loggers.

Data flows one way: each worker reports rank-local counts and metrics (``worker_reports.py``); a
controller callback sums them into one global `Timestamp` and metrics history (``aggregate.py``)
and pushes the entries to the run's history actor (``history.py``); another records each failed worker group
(``failures.py``); the driver follows it
(``follow.py``) for its progress bar (``progress.py``), its loggers (``run_loggers.py``) and its
terminal (``console.py``).

Files:

* ``aggregate.py``: Driver-side aggregation of worker reports into one global `Timestamp` and
  metrics history.
* ``console.py``: A Ray run's terminal: the driver's progress bar and the job's own lines; Ray's
  internals stay in its log files.
* ``failures.py``: `FailureRecorder`: each worker group's failure, as Ray Train's controller saw it,
  in the run directory.
* ``follow.py``: `HistoryFollower`: the driver's view of a run while it trains (progress bar,
  loggers).
* ``history.py``: The driver's record of a run: a small Ray actor the controller pushes history
  entries to.
* ``progress.py``: The driver's one progress bar for a Ray run: the global Timestamp, loss, latest
  eval metric, throughput, ETA.
* ``run_loggers.py``: Loggers on Ray: the shipped logger destinations fed from the driver's run
  history.
* ``worker_reports.py``: Worker-side reporting: send rank-local counts and metrics to the
  controller at intervals.
"""
