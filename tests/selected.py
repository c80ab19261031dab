"""Which parameters of a parametrized test this pytest session will run (after -k, -m and xdist splits): a
module fixture starts their slow subprocesses together, a few at a time, and each test then waits only for its
own (tests/test_entry_points.py, tests/test_docs_commands.py)."""

from __future__ import annotations

from typing import Any

import pytest


def selected_params(request: pytest.FixtureRequest, test_name: str, param: str) -> list[Any]:
    """The values of ``param`` that the session's items of ``test_name`` in the requesting module take, in
    collection order, each once."""
    values = [
        item.callspec.params[param]
        for item in request.session.items
        if getattr(item, "originalname", None) == test_name
        and item.module is request.module
        and hasattr(item, "callspec")
    ]
    return list(dict.fromkeys(values))
