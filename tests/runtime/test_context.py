"""The job's store-key namespaces (:meth:`prague.runtime.context.DistContext.namespace`)."""

from __future__ import annotations

import pytest
import torch

from prague.errors import ConfigError
from prague.runtime.context import DistContext


def _ctx() -> DistContext:
    return DistContext(rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu"),
                       store=None, timeout_s=5)  # type: ignore[arg-type]


def test_unnamed_methods_are_numbered_per_kind_and_named_ones_keep_their_name() -> None:
    ctx = _ctx()
    assert [ctx.namespace("prague"), ctx.namespace("lossy"), ctx.namespace("prague")] == \
        ["prague/0", "lossy/0", "prague/1"]
    assert ctx.namespace("prague", "student") == "student"
    assert ctx.namespace("prague") == "prague/2"  # a named method takes no number


@pytest.mark.parametrize("name, message", [("", "non-empty"), ("a/b", "without '/'"), ("student", "already")])
def test_a_bad_or_repeated_name_is_refused_with_the_fix(name: str, message: str) -> None:
    ctx = _ctx()
    ctx.namespace("lossy", "student")
    with pytest.raises(ConfigError, match=message) as caught:
        ctx.namespace("prague", name)
    assert "name" in str(caught.value)


def test_a_job_wide_component_is_claimed_once() -> None:
    ctx = _ctx()
    assert ctx.first_of_job("ps-own-shards") and not ctx.first_of_job("ps-own-shards")
    assert ctx.namespace("x", "ps-own-shards") == "ps-own-shards"  # a method's name is another space
