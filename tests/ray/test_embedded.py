"""The embedded local instance's start-up settings, without starting Ray: the variables set for
``ray.init`` and restored after, and Ray's token-authentication notice kept off the terminal."""

from __future__ import annotations

import logging
import os

import pytest

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


def test_the_state_api_asks_only_this_instance_or_nothing(monkeypatch):
    """Ray Train's placement-group cleaner polls the state API for its controller; unset, the API server is found
    through the machine's newest Ray instance, which may be another one: there the controller is not found, the
    cleaner takes it for dead and removes the run's placement group (every worker ends: a whole-run restart).
    Without a dashboard every call must fail (the cleaner skips those), with one it is this instance's."""
    from ray.util.state import get_actor
    from ray.util.state.exception import RayStateApiException

    from raytrain_events.ray.embedded import NO_API_SERVER, own_state_api

    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    for verbose in (False, True):
        with local_instance({"include_dashboard": False}, verbose=verbose):
            assert os.environ["RAY_API_SERVER_ADDRESS"] == NO_API_SERVER
            with pytest.raises(RayStateApiException):  # what the cleaner's loop catches and skips
                get_actor("0" * 32, timeout=2)
        assert "RAY_API_SERVER_ADDRESS" not in os.environ
    kwargs: dict = {"include_dashboard": True}
    with own_state_api(kwargs):
        if _compat.dashboard_installed():
            assert os.environ["RAY_API_SERVER_ADDRESS"] == f"http://127.0.0.1:{kwargs['dashboard_port']}"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265")
    with own_state_api({"include_dashboard": False}):  # the user's own setting is kept
        assert os.environ["RAY_API_SERVER_ADDRESS"] == "http://127.0.0.1:8265"
