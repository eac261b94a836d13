"""The environment of an embedded local Ray instance: what is set before ``ray.init`` starts it.

`raytrain_events.ray.reports.console` decides which of Ray's lines reach the terminal during a run; some
of those lines are best dealt with at their cause, when the instance starts (its processes read
their settings from the environment they inherit). This module sets those variables for the
``ray.init`` call only, and gives the dashboard a known loopback port so that Ray's state API
(which Ray Train's placement-group cleaner polls) answers, and answers for this instance, never for
another Ray instance on the machine (`own_state_api`; without a dashboard every call fails, which the
cleaner skips). See the table in
`raytrain_events.ray.reports.console` for the line each setting removes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Dict, Iterator, List

from raytrain_events.ray import _compat

__all__ = ["local_instance", "own_state_api", "NO_API_SERVER"]


@contextlib.contextmanager
def local_instance(init_kwargs: Dict[str, Any], *, verbose: bool) -> Iterator[None]:
    """Settings for an embedded local Ray started inside this block; ``init_kwargs`` gain the dashboard's.

    Ray's processes inherit this process's environment when they start, so the variables are set
    for the ``ray.init`` call only and restored afterwards. ``verbose=True`` changes only the state
    API's address (`own_state_api`: the run's survival, not its console).
    """
    if verbose:
        with own_state_api(init_kwargs):
            yield
        return
    num_cpus = int(init_kwargs.get("num_cpus") or os.cpu_count() or 1)
    env = {
        _compat.STARTUP_CONCURRENCY_ENV: str(max(8, num_cpus)),
        "RAY_DATA_LOGGING_CONFIG": os.path.join(os.path.dirname(__file__), "ray_data_logging.yaml"),
        **_state_api_env(init_kwargs),
    }
    notices = _HoldTokenNotice()
    logger = logging.getLogger(_compat.TOKEN_AUTH_LOGGER)
    logger.addFilter(notices)
    try:
        with _environ(env):
            yield
    finally:
        logger.removeFilter(notices)
        notices.write_to_session_logs()


# A loopback port nothing listens on (tcpmux, privileged): the state API's calls there fail at once.
NO_API_SERVER = "http://127.0.0.1:1"


def _state_api_env(init_kwargs: Dict[str, Any]) -> Dict[str, str]:
    """``RAY_API_SERVER_ADDRESS`` for the instance's processes: its dashboard's (given a known loopback port
    in ``init_kwargs``), or without a dashboard `NO_API_SERVER`. Unset, Ray's state API finds the API server
    through the address file of the machine's newest Ray instance (`_compat.ray_address_file`), which may be
    another one with a dashboard. Ray Train's placement-group cleaner polls that API for its controller; in another
    instance it finds no such actor, takes the controller for dead and removes the run's placement group,
    ending every worker at once (a restart of the whole run). Failing calls are what the cleaner skips."""
    if _compat.dashboard_installed() and init_kwargs.get("include_dashboard") is not False:
        port = init_kwargs.setdefault("dashboard_port", _free_port())
        init_kwargs.setdefault("dashboard_host", "127.0.0.1")
        return {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
    return {"RAY_API_SERVER_ADDRESS": NO_API_SERVER}


@contextlib.contextmanager
def own_state_api(init_kwargs: Dict[str, Any]) -> Iterator[None]:
    """Only `_state_api_env`, for a ``ray.init`` of a local instance inside this block (a test session's or a
    benchmark's own start); the variable is restored afterwards (a value already set is kept)."""
    with _environ(_state_api_env(init_kwargs)):
        yield


@contextlib.contextmanager
def _environ(env: Dict[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` inside this block (a value already set is kept), restored afterwards."""
    saved = {key: os.environ.get(key) for key in env}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _HoldTokenNotice(logging.Filter):
    """Keeps Ray's "token authentication is enabled" notice off the terminal, for the session's logs.

    ``ray.init`` logs it at WARNING as the first line of every run (token auth is on by default for
    a local instance since Ray 2.52); it asks nothing of the user. The notice that token auth is
    *disabled* (a security warning the user chose to get) still shows.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: List[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(_compat.TOKEN_AUTH_ENABLED):
            self.held.append(record)
            return False
        return True

    def write_to_session_logs(self) -> None:
        """Append the held notices to ``<session>/logs/raytrain_events_driver.log`` (if Ray started)."""
        logs = _compat.session_logs_dir() if self.held else None
        if logs is None:
            return
        with open(os.path.join(logs, "raytrain_events_driver.log"), "a") as fh:
            for record in self.held:
                fh.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
