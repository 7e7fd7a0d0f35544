"""Top-n-sigma filtering on the device against the plain torch statement of it."""

from __future__ import annotations

import pytest

from tests.unit.test_top_n_sigma import check_top_n_sigma

pytestmark = pytest.mark.gpu


def test_top_n_sigma_matches_the_reference_on_cuda():
    check_top_n_sigma("cuda")
