"""The output comparators every backend test leans on fail where they must: a wrong
dtype or shape, a float outside tolerance, an integer off by one bit."""

from __future__ import annotations

import numpy as np
import pytest
from corpus.compare import assert_leaf_matches, assert_trees_match
from productionlib.cases import assert_close


@pytest.mark.parametrize("compare", [assert_trees_match, assert_close])
def test_both_comparators_accept_close_floats_and_equal_integers(compare):
    a = {"f": np.float32([1.0, 2.0]), "i": np.int32([3, 4])}
    b = {"f": np.float32([1.0, 2.0 + 1e-7]), "i": np.int32([3, 4])}
    compare(a, b)


@pytest.mark.parametrize("compare", [assert_trees_match, assert_close])
@pytest.mark.parametrize(
    "got, message",
    [
        (np.float64([1.0, 2.0]), "dtype float64 != float32"),
        (np.float32([1.0, 2.0, 3.0]), r"shape \(3,\) != \(2,\)"),
        (np.float32([1.0, 2.1]), "Not equal to tolerance"),
    ],
)
def test_both_comparators_reject_a_wrong_dtype_shape_or_value(compare, got, message):
    with pytest.raises(AssertionError, match=message):
        compare([got], [np.float32([1.0, 2.0])])


def test_integers_are_compared_bitwise_and_the_leaf_is_named():
    with pytest.raises(AssertionError, match="leaf 'w'"):
        assert_leaf_matches(np.int32([1, 2]), np.int32([1, 3]), "leaf 'w'", rtol=1.0, atol=1.0)
    with pytest.raises(AssertionError, match=r"\[1\]"):
        assert_trees_match([np.int32(1), np.uint8(7)], [np.int32(1), np.uint8(6)], atol=10)
