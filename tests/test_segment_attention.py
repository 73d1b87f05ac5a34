"""The segment attention (hadw_kernels/layouts/segments.py): each segment of a packed row
attends within itself (and to its prefix, a shared prompt) at its own cost, equal to
dense attention under the mask the segments describe (a prefix of several spans, a prefix
tree's ancestors, too), forward and backward; on the
device the suite runs on (HADW_TEST_DEVICE=cuda: the varlen flash path in half precision
too). The models' side (hidden states, a train step's gradient) is in
tests/test_trainer_micro_batches.py."""

import os

import pytest
import torch

from hadw_kernels.layouts.segments import VARLEN, Segments

# The suite's device (tests/conftest.py): the CPU, or a GPU under HADW_TEST_DEVICE=cuda.
DEVICE = torch.device(os.environ.get("HADW_TEST_DEVICE", "cpu"))

# (start, length, prefix spans): samples packed one after another, some of them empty or a
# single token; then groups whose responses read a shared prompt.
PACKED = Segments.packed([0, 5, 5, 13, 14, 40])
SHARED = Segments.of([(0, 6, ()), (6, 9, ((0, 6),)), (15, 1, ((0, 6),)), (16, 9, ((0, 6),)), (25, 3, ()),
                      (28, 4, ((25, 3),)), (32, 2, ())])
# A prefix tree, depth first: a trunk, two children, a grandchild of the first reading the
# trunk and part of its parent, a second grandchild, and a node two spans apart from its
# ancestors' (trunk, first child's head).
TREE = Segments.of([(0, 5, ()), (5, 4, ((0, 5),)), (9, 3, ((0, 5), (5, 2))), (12, 2, ((0, 5), (5, 4))),
                    (14, 6, ((0, 3),)), (20, 3, ((0, 5), (5, 1)))])
# Many shapes: over the bucket count at which CUDA half precision takes the varlen path.
MANY_SHAPES = Segments.of([(sum(range(n)), n, ()) for n in range(1, 12)])


def allowed_keys(segments: Segments) -> torch.Tensor:
    """[N, N], true where a query may read a key: query j of a segment reads its prefix
    spans and its own positions up to j."""
    allowed = torch.zeros(segments.tokens, segments.tokens, dtype=torch.bool)
    for start, length, spans in zip(segments.starts, segments.lengths, segments.prefixes):
        for j in range(length):
            for prefix, prefix_length in spans:
                allowed[start + j, prefix:prefix + prefix_length] = True
            allowed[start + j, start:start + j + 1] = True
    return allowed


def dense_attention(query, key, value, segments: Segments, scaling):
    """float64 attention under the mask the segments describe (:func:`allowed_keys`)."""
    heads = query.shape[1]
    repeat = heads // key.shape[1]
    q = query[0].double()
    k, v = (t[0].double().repeat_interleave(repeat, 0) for t in (key, value))
    allowed = allowed_keys(segments).to(query.device)
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).unsqueeze(0)


def _inputs(segments, dtype, heads=4, kv_heads=2, head_dim=16):
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, heads, segments.tokens, head_dim), *[(1, kv_heads, segments.tokens, head_dim)] * 2]
    return [torch.randn(shape, generator=generator).to(DEVICE, dtype).requires_grad_() for shape in shapes]


DTYPES = [torch.float64, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("segments", [PACKED, SHARED, TREE, MANY_SHAPES], ids=["packed", "shared", "tree", "many-shapes"])
def test_equals_dense_attention_under_the_segments_mask(segments, dtype):
    """Output and the gradients of query, key and value under a non-uniform upstream
    gradient, against float64 dense attention; a fast path's error no larger than the
    same-dtype dense computation's plus a small tolerance (the peers' rule)."""
    query, key, value = _inputs(segments, dtype)
    scaling = 0.3
    out = segments.attend(query, key, value, scaling=scaling, dropout=0.0)
    assert out.shape == (1, segments.tokens, query.shape[1], query.shape[-1]) and out.dtype == dtype
    reference = dense_attention(query, key, value, segments, scaling)
    upstream = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float64)
    got = torch.autograd.grad(out, (query, key, value), upstream.to(dtype))
    expected = torch.autograd.grad(reference, (query, key, value), upstream)
    # The same-dtype dense computation's error: the bar a fast path is held to.
    same_dtype = dense_attention(*(t.detach().to(dtype).double() for t in (query, key, value)), segments, scaling)
    slack = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    bar = float((same_dtype - reference.detach()).abs().max()) + slack
    assert float((out.double() - reference).abs().max()) <= max(bar, 10 * slack)
    for name, mine, theirs in zip("qkv", got, expected):
        error = float((mine.double() - theirs).abs().max())
        assert error <= 10 * slack * max(1.0, float(theirs.abs().max())), (name, error)


@pytest.mark.skipif(DEVICE.type != "cuda" or VARLEN is None, reason="the varlen path needs CUDA and torch's varlen_attn")
def test_cuda_half_precision_takes_varlen_where_shapes_are_many_or_prefixed():
    half = _inputs(MANY_SHAPES, torch.bfloat16)[0]
    assert MANY_SHAPES._use_varlen(half, 0.0) and SHARED._use_varlen(half, 0.0)
    assert TREE._use_varlen(_inputs(TREE, torch.bfloat16)[0], 0.0)
    assert not PACKED._use_varlen(half, 0.0)  # few shapes: batched sdpa
    assert not MANY_SHAPES._use_varlen(half.float(), 0.0)  # flash takes no float32


@pytest.mark.parametrize("segments", [SHARED, TREE], ids=["shared", "tree"])
def test_the_varlen_path_gathers_each_segment_s_keys(segments):
    """The varlen path (CUDA) reads each segment's keys through one index, its prefix spans
    then its own positions, and offsets into it: checked here on the CPU against the keys
    the segments' mask lets the segment's last query read."""
    tensors = segments._device_tensors(torch.device("cpu"))
    allowed = allowed_keys(segments)
    keys = tensors["key_index"].tolist()
    offsets = tensors["cu_k"].tolist()
    for index, (start, length) in enumerate(zip(segments.starts, segments.lengths)):
        mine = keys[offsets[index]:offsets[index + 1]]
        assert sorted(mine) == allowed[start + length - 1].nonzero().flatten().tolist(), index
        assert mine[-length:] == list(range(start, start + length)), index


def test_costs_the_segments_own_squares():
    """The pairs formed: each segment's length times its keys (prefix and itself), not the
    row's length squared as a dense mask would."""
    assert PACKED.score_count() == 5 * 5 + 8 * 8 + 1 + 26 * 26
    assert SHARED.score_count() == 36 + 9 * 15 + 1 * 7 + 9 * 15 + 9 + 4 * 7 + 4
    assert SHARED.score_count() < SHARED.tokens ** 2 / 2
    assert TREE.score_count() == 25 + 4 * 9 + 3 * 10 + 2 * 11 + 6 * 9 + 3 * 9


def test_a_row_the_segments_do_not_describe_is_refused():
    query, key, value = _inputs(PACKED, torch.float32)
    with pytest.raises(ValueError, match="cannot serve a batch"):
        SHARED.attend(query, key, value, scaling=None, dropout=0.0)
    with pytest.raises(ValueError, match="tile the row"):
        Segments.of([(0, 3, ()), (2, 3, ())])
    with pytest.raises(ValueError, match="tile the row"):
        Segments.of([(0, 3, ()), (4, 3, ())])
    with pytest.raises(ValueError, match="must lie before its queries"):
        Segments.of([(0, 3, ()), (3, 3, ((2, 3),))])
    with pytest.raises(ValueError, match="must lie before its queries"):
        Segments.of([(0, 3, ()), (3, 3, ((0, 2), (1, -1)))])
    with pytest.raises(ValueError, match="one entry a segment"):
        Segments((0,), (1,), ())
