"""The 8-bit codes of compressed averaging, and the error feedback that carries what they leave out."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.comm.codecs import BLOCK, blocks, check_codec, member_send_bytes, payload_bytes
from prague.comm.compress import ErrorFeedback, decode, encode
from prague.errors import ConfigError


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 3 * BLOCK + 7), scale=st.floats(1e-6, 1e3), seed=st.integers(0, 2**16))
def test_a_value_comes_back_within_half_a_step_of_its_block(numel: int, scale: float, seed: int) -> None:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    payload = encode(values)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(numel, "int8")
    back = decode(payload, numel, torch.empty(numel))
    padded = torch.cat((values, values[-1:].expand(blocks(numel) * BLOCK - numel))).view(-1, BLOCK)
    step = (padded.amax(1) - padded.amin(1)) / 255
    bound = step.repeat_interleave(BLOCK)[:numel] / 2 + 1e-6 * scale
    assert bool(((back - values).abs() <= bound).all())


def test_a_constant_block_is_exact() -> None:
    values = torch.full((BLOCK + 3,), 0.125)
    assert torch.equal(decode(encode(values), values.numel(), torch.empty_like(values)), values)


def test_a_message_of_the_wrong_size_is_refused() -> None:
    payload = encode(torch.randn(300))
    with pytest.raises(ValueError, match="has .* bytes"):
        decode(payload, 301, torch.empty(301))


def test_error_feedback_carries_what_a_message_left_out_until_it_is_committed() -> None:
    feedback = ErrorFeedback()
    x = torch.randn(700, generator=torch.Generator().manual_seed(3))
    feedback.encode(x)
    assert feedback.sent is not None
    first = feedback.sent.clone()
    # not committed (a failed group, retried): the retry sends the same, the residual stays zero
    feedback.encode(x)
    assert torch.equal(feedback.sent, first)
    feedback.commit()
    assert feedback.residual is not None
    torch.testing.assert_close(feedback.residual, x - first, rtol=0, atol=1e-7)
    # over many messages of the same values, what was sent averages to the values: nothing is lost
    total = first.clone()
    rounds = 64
    for _ in range(rounds - 1):
        feedback.encode(x)
        total += feedback.sent
        feedback.commit()
    torch.testing.assert_close(total / rounds, x, rtol=0, atol=float((x.max() - x.min()) / 255 / rounds) * 4)


def test_compressed_groups_send_about_a_quarter_of_the_bytes() -> None:
    numel = 470_000
    for members in (2, 3, 4):
        full, small = member_send_bytes(numel, members, "none"), member_send_bytes(numel, members, "int8")
        assert small == (members - 1) * payload_bytes(numel, "int8")
        assert full == pytest.approx(2 * (members - 1) / members * 4 * numel)
        assert small < full / 1.9
    assert member_send_bytes(numel, 1, "int8") == 0.0
    with pytest.raises(ConfigError, match="none, int8"):
        check_codec("fp4")
