"""Pure logic of the loop: no Ray, no fsspec, no I/O (``tests/core/test_imports.py`` guards it).

Time: ``time`` (the import path for all of it) re-exports ``time_value`` (`TimeUnit`, `Time`) and
``timestamp`` (`Timestamp`, the run's progress counter, and the counter names and units).
The loop's vocabulary: ``event`` (`Event`, in the order the loop fires them), ``state``
(`State`), ``algorithm`` (`Algorithm`: match/apply), ``callback`` (`Callback`), ``engine``
(`Engine`: runs them at each event, records `Trace`s), ``logger`` (`Logger`,
`LoggerDestination`), ``data_spec`` (`DataSpec`: counting samples and tokens, microbatches),
``precision`` (autocast from a string), ``interval`` (when periodic things are due).
Across ranks: ``agreement`` (flags all ranks agree on at the same batch) and ``heartbeat`` (a
process's last progress, for the hang watchdog). ``plain`` converts values to plain data.

This file imports nothing: it exists so that tools that read packages (the API reference's
mkdocstrings, type checkers) see ``core`` as a package.
"""
