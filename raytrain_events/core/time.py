"""Training time: units (epochs, batches, samples, tokens, fraction of the run) and the progress counter.

A port of Composer's ``composer.core.time`` so schedules, callbacks and max-duration checks can speak in
"5ep" / "3e4tok" / "0.5dur", plus a cheap immutable ``Timestamp`` the trainer advances once per batch.

This is the module to import from. The code lives in two files, one job each:
`raytrain_events.core.time_value` (`TimeUnit`, `Time`, parsing, `ensure_time`, `training_duration`) and
`raytrain_events.core.timestamp` (`Timestamp` and the counter-name map `COUNTER_UNITS`,
`report_key`, `counters_of`).

>>> Time.from_timestring("3ep") + "2ep"
Time(5, TimeUnit.EPOCH)
>>> report_key("sp"), Timestamp(sample=64).get(TimeUnit.SAMPLE)
('time/sample', Time(64, TimeUnit.SAMPLE))
"""

from __future__ import annotations

from raytrain_events.core.time_value import Time as Time
from raytrain_events.core.time_value import TimeUnit as TimeUnit
from raytrain_events.core.time_value import ensure_time as ensure_time
from raytrain_events.core.time_value import training_duration as training_duration
from raytrain_events.core.timestamp import COUNTER_UNITS as COUNTER_UNITS
from raytrain_events.core.timestamp import Timestamp as Timestamp
from raytrain_events.core.timestamp import counters_of as counters_of
from raytrain_events.core.timestamp import report_key as report_key

# Composer's names; COUNTER_UNITS, report_key and counters_of are importable from here too.
__all__ = ["TimeUnit", "Time", "Timestamp", "ensure_time", "training_duration"]
