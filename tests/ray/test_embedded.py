"""The embedded local instance's start-up settings, without starting Ray: the variables set for
``ray.init`` and restored after, and Ray's token-authentication notice kept off the terminal."""

from __future__ import annotations

import logging
import os

from raytrain_events.ray import _compat
from raytrain_events.ray.embedded import local_instance


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_token_notice_stays_off_the_terminal_and_the_disabled_warning_shows(monkeypatch):
    monkeypatch.delenv(_compat.STARTUP_CONCURRENCY_ENV, raising=False)
    terminal = _Lines()  # stands for the "ray" logger's console handler
    ray_logger = logging.getLogger("ray")
    ray_logger.addHandler(terminal)
    notice = logging.getLogger(_compat.TOKEN_AUTH_LOGGER)
    init_kwargs = {"num_cpus": 2, "include_dashboard": False}
    try:
        with local_instance(init_kwargs, verbose=False):
            assert os.environ[_compat.STARTUP_CONCURRENCY_ENV] == "8"
            notice.warning(_compat.TOKEN_AUTH_ENABLED + ". Set RAY_AUTH_MODE=disabled to opt out.")
            notice.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
        notice.warning(_compat.TOKEN_AUTH_ENABLED + " (outside the start: not ours to hide)")
        with local_instance({}, verbose=True):
            notice.warning(_compat.TOKEN_AUTH_ENABLED + " (verbose)")
    finally:
        ray_logger.removeHandler(terminal)
    assert _compat.STARTUP_CONCURRENCY_ENV not in os.environ
    assert terminal.lines == [
        "Token authentication is disabled for this Ray cluster. Anyone with network access ...",
        _compat.TOKEN_AUTH_ENABLED + " (outside the start: not ours to hide)",
        _compat.TOKEN_AUTH_ENABLED + " (verbose)",
    ]
