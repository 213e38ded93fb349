"""A mixture's schedule (:mod:`tokenfeed.order.schedule`), tested directly: weights made
exact integers and reduced, and every invalid schedule refused with the fix. Pure Python."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tokenfeed.errors import ConfigError
from tokenfeed.mixture import Mixture
from tokenfeed.order.schedule import MAX_PERIOD, check_name, is_list, parse_schedule


def test_weights_are_reduced_per_segment() -> None:
    assert parse_schedule({"web": 0.7, "code": 0.2, "math": 0.1}) == [
        (0, {"web": 7, "code": 2, "math": 1})
    ]
    assert parse_schedule({"a": 1, "b": 0.5}) == [(0, {"a": 2, "b": 1})]
    assert parse_schedule({"a": 0.33333, "b": 0.66667}) == [(0, {"a": 3333, "b": 6667})]
    assert parse_schedule({"a": np.float32(0.7), "b": np.int64(3)}) == [(0, {"a": 7, "b": 30})]
    # a schedule: each segment reduced on its own, sources absent where not given
    assert parse_schedule([(0, {"a": 2, "b": 4}), (10, {"b": 0.5})]) == [
        (0, {"a": 1, "b": 2}),
        (10, {"b": 1}),
    ]
    assert parse_schedule({"a": MAX_PERIOD - 1, "b": 1}) == [(0, {"a": MAX_PERIOD - 1, "b": 1})]


def test_names_and_lists() -> None:
    assert check_name("web") == "web"
    assert is_list([1]) and is_list((1,))
    assert not is_list("ab") and not is_list(b"ab") and not is_list({"a": 1})


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ({"web": True}, "must be a positive int or float, got True"),
        ({"web": "3"}, "must be a positive int or float"),
        ({"web": 0}, "must be positive, got 0; leave a source out"),
        ({"web": -2}, "must be positive"),
        ({"web": 1, "code": float("nan")}, "positive finite number"),
        ({"web": float("inf")}, "positive finite number"),
        ({"web": 1.0, "code": 0.00004}, "is 0 at 4 decimals.*scale all weights"),
        ({}, "empty; give at least one source"),
        ({3: 1}, "names must be strings"),
        ({"": 1}, "invalid source name ''"),
        ({" web": 1}, "no leading or trailing spaces"),
        ({"a": MAX_PERIOD, "b": 1}, f"summing to {MAX_PERIOD + 1}, more than {MAX_PERIOD}"),
        ({"a": 3.1416, "b": 3.7183}, "'a': 3.1416, 'b': 3.7183.*summing to 68599"),
        ([], "schedule is empty"),
        ([(5, {"web": 1})], "starts at stream position 0.*add the blend"),
        ([(0, {"web": 1}), (0, {"code": 1})], "strictly increasing"),
        ([(0, {"web": 1}), (9, {"code": 1}), (3, {"web": 1})], "strictly increasing"),
        ([(0, {"web": 1}), (-1, {"code": 1})], "must lie in"),
        ([(False, {"web": 1})], "start must be an integer"),
        ([(0, {"web": 1}, 5)], "got 3 items"),
        ([{"web": 1}], "must be a \\(start position, weights\\) pair"),
        ([(0, [("web", 1)])], "must be a mapping"),
        ("web", "a mixture is a mapping"),
        (7, "a mixture is a mapping"),
        ([(0, {"web": 1}), (10, {"web": 2**17, "code": 1})], "segment 1 \\(start 10\\)"),
    ],
)
@pytest.mark.parametrize("build", [parse_schedule, Mixture])
def test_invalid_schedules_say_what_to_do(
    build: Callable[[object], object], schedule: object, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        build(schedule)
