"""The token layout (hadw_kernels/batch/token_layout.py): both layouts as tokens in segments, and the
offsets of a padding-free trainer's position ids."""

import pytest
import torch

from hadw_kernels import HADWGRPOLoss, LinearHADWGRPOLoss, cu_seqlens_from_position_ids, fused_hadw_grpo_loss
from hadw_kernels.batch.token_layout import TokenLayout


def test_segments_of_a_packed_layout():
    """Empty segments at the start, inside and at the end own no token."""
    layout = TokenLayout.packed(torch.tensor([0, 0, 3, 3, 4, 4]), (4,))
    assert layout.segments == 5 and layout.tokens == 4 and layout.is_packed
    assert layout.token_segment.tolist() == [1, 1, 1, 3]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert layout.segment_sum(values).tolist() == [0.0, 6.0, 0.0, 4.0, 0.0]
    assert layout.expand(torch.arange(5.0)).tolist() == [1.0, 1.0, 1.0, 3.0]
    assert layout.per_token(torch.arange(5.0)).tolist() == [1.0, 1.0, 1.0, 3.0]  # one per segment
    assert layout.per_token(values[None]).tolist() == values.tolist()  # [1, N]: per token


def test_segments_of_a_padded_layout():
    layout = TokenLayout.padded(3, 2, torch.device("cpu"))
    assert layout.cu_seqlens.tolist() == [0, 2, 4, 6] and not layout.is_packed
    assert layout.token_segment.tolist() == [0, 0, 1, 1, 2, 2]
    assert layout.restore(torch.arange(6.0)).shape == (3, 2)


def test_packed_segment_sums_accumulate_like_eager_sums():
    """A bf16 segment's sum accumulates in fp32 and rounds once, as eager ``sum`` does
    over a padded row: summing 4096 values of 1 in bf16 would stop at 256."""
    values = torch.ones(4096, dtype=torch.bfloat16)
    packed = TokenLayout.packed(torch.tensor([0, 4096]), (4096,)).segment_sum(values)
    padded = TokenLayout.padded(1, 4096, torch.device("cpu")).segment_sum(values)
    assert packed.dtype == torch.bfloat16 and packed.item() == padded.item() == 4096


def test_offsets_from_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    cu_seqlens = cu_seqlens_from_position_ids(positions)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 4, 8]
    assert cu_seqlens_from_position_ids(positions[0]).tolist() == [0, 3, 4, 8]
    assert cu_seqlens_from_position_ids(torch.zeros(0, dtype=torch.long)).tolist() == [0]


@pytest.mark.parametrize("positions, error, match", [
    (torch.tensor([1, 2, 0, 1]), ValueError, "must start at 0"),
    # Not a packed row's positions: a gap, a repeat, a sample that does not restart at 0.
    (torch.tensor([0, 1, 3, 0, 1]), ValueError, "position 2 holds 3 where its sample's count gives 2"),
    (torch.tensor([0, 1, 1, 2]), ValueError, "position 2 holds 1 where its sample's count gives 2"),
    (torch.tensor([0, 1, 2, 5, 6, 0]), ValueError, "position 3 holds 5 where its sample's count gives 3"),
    (torch.zeros(2, 4, dtype=torch.long), ValueError, r"\[N\] or \[1, N\]"),
    (torch.zeros(4), TypeError, "integer tensor"),
    ([0, 1, 0], TypeError, "integer tensor"),
])
def test_bad_position_ids(positions, error, match):
    with pytest.raises(error, match=match):
        cu_seqlens_from_position_ids(positions)


def test_a_packed_call_from_position_ids_equals_the_padded_call():
    """Responses packed as a padding-free trainer packs them, offsets taken from the
    position ids, give the padded batch's loss and gradient."""
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2, 4]
    padded = -torch.rand(4, 5, generator=generator, dtype=torch.float64)
    old = padded + 0.1 * torch.randn(4, 5, generator=generator, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = padded[mask].detach().requires_grad_()
    padded = padded.requires_grad_()
    expected = fused_hadw_grpo_loss(padded, old, rewards, mask, group_size=2, anchor=0.4)
    loss = fused_hadw_grpo_loss(packed[None], old[mask][None], rewards, torch.ones_like(packed, dtype=torch.bool)[None],
                                cu_seqlens=cu_seqlens_from_position_ids(position_ids), group_size=2, anchor=0.4)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(packed.grad, padded.grad[mask])


def test_the_modules_take_cu_seqlens_per_call():
    logprobs = -torch.rand(7, dtype=torch.float64)
    mask = torch.tensor([False, True, True, True, True, False, True])
    cu_seqlens = torch.tensor([0, 3, 3, 5, 7])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    expected = fused_hadw_grpo_loss(logprobs, None, rewards, mask, cu_seqlens=cu_seqlens, group_size=2)
    module = HADWGRPOLoss(group_size=2)
    torch.testing.assert_close(module(logprobs, None, rewards, mask, cu_seqlens=cu_seqlens), expected)
    hidden, weight = torch.randn(7, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    labels = torch.randint(0, 16, (7,))
    linear = LinearHADWGRPOLoss(group_size=2)(hidden, weight, labels, None, rewards, mask, cu_seqlens=cu_seqlens)
    assert torch.isfinite(linear)
    with pytest.raises(TypeError, match="cu_seqlens"):
        HADWGRPOLoss(cu_seqlens=cu_seqlens)  # a tensor of the call, not an option
