"""``prague --average-by samples``: each member weighs its steps since its own last average."""

from __future__ import annotations

import pytest
import torch

from prague.algorithms.prague import PragueOptions
from prague.algorithms.prague.weights import SinceAverage
from prague.errors import ConfigError
from prague.sim.math import group_mean


def test_a_weight_counts_the_steps_since_the_last_average_that_averaged() -> None:
    since = SinceAverage()
    assert since.weight(0) == 1.0  # the first step
    since.averaged(0)
    assert since.weight(3) == 3.0  # steps 1, 2, 3: groups of one in between do not reset it
    assert since.weight(3) == 3.0  # a failed group retried weighs the same
    since.averaged(3)
    assert since.weight(3) == 1.0  # the committed groups after the last step weigh at least 1
    since.averaged(2)  # never moves back
    assert since.weight(5) == 2.0


def test_the_group_mean_is_weighted_by_member() -> None:
    rows = torch.tensor([[0.0, 4.0], [8.0, 4.0], [2.0, 1.0]], dtype=torch.float64)
    assert torch.equal(group_mean(rows, [0, 3, 5], None), rows.mean(dim=0))
    weighted = group_mean(rows, [0, 3, 5], {3: 3.0, 0: 1.0, 5: 4.0})
    assert torch.allclose(weighted, (rows[0] * 1 + rows[1] * 3 + rows[2] * 4) / 8)


def test_weighted_averaging_of_compressed_codes_is_refused() -> None:
    with pytest.raises(ConfigError, match="--average-by samples .* --compress int8"):
        PragueOptions(average_by="samples", compress="int8")
    with pytest.raises(ConfigError, match="equal, samples"):
        PragueOptions(average_by="time")
