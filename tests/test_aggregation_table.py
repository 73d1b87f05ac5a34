"""tables.aggregations.AGGREGATIONS is the one description of the aggregation modes: the reference
and every backend read it. A mode's weights come out of the reference and the Triton
host code as the table says, and the C++ build carries the table it was compiled with."""

import json

import pytest
import torch

from hadw_kernels.backends import cpp_constants
from hadw_kernels.batch.token_layout import TokenLayout
from hadw_kernels.config.loss_config import LossConfig
from hadw_kernels.formulas.aggregation import agg_weights, aggregate
from hadw_kernels.tables import aggregations as aggregation_table
from hadw_kernels.tables.aggregations import AGG_MODES, AGGREGATIONS


def _expected(rule, lengths, width, normalizer, max_length):
    count = {"tokens": sum(lengths), "responses": len(lengths), "one": 1}[rule.count]
    base = normalizer or max(count, 1)
    if rule.times_max_length:
        base *= max_length or width
    return [1.0 / (base * (max(n, 1) if rule.per_response_mean else 1)) for n in lengths]


def _layouts(lengths, width):
    """The same responses padded to ``width`` and packed (each segment led by a prompt
    token): (layout, mask [N], the flat index of each padded position's token or -1)."""
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    padded = TokenLayout.padded(len(lengths), width, torch.device("cpu"))
    segments = [torch.cat([torch.tensor([False]), torch.ones(n, dtype=torch.bool)]) for n in lengths]
    cu_seqlens = torch.tensor([0] + [len(s) for s in segments]).cumsum(0)
    packed_mask = torch.cat(segments)
    packed = TokenLayout.packed(cu_seqlens, tuple(packed_mask.shape))
    return [(padded, mask.reshape(-1)), (packed, packed_mask)]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("normalizer", [None, 7.0])
def test_reference_weights_follow_the_table(mode, normalizer):
    lengths = [3, 0, 5, 1]
    # L as the losses resolve it: the normaliser's constant, else the padded width.
    loss_config = LossConfig.build("grpo", None, loss_agg_mode=mode, loss_normalizer=normalizer,
                                   max_response_length=9 if normalizer else 6)
    expected = _expected(AGGREGATIONS[mode], lengths, 6, normalizer, loss_config.max_response_length)
    values = torch.randn(4, 6, dtype=torch.float64)
    direct = sum(w * float(values[i, :n].sum()) for i, (w, n) in enumerate(zip(expected, lengths)))
    for layout, mask in _layouts(lengths, 6):
        assert agg_weights(mask, layout, loss_config).tolist() == pytest.approx(expected, rel=1e-15)
        flat = torch.full((layout.tokens,), float("nan"), dtype=torch.float64)
        flat[mask] = values[torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]]
        assert float(aggregate(flat, mask, layout, loss_config)) == pytest.approx(direct, rel=1e-12)


def test_triton_host_code_follows_the_table():
    surrogate = pytest.importorskip("hadw_kernels.triton.surrogate", exc_type=ImportError)
    for index, mode in enumerate(AGG_MODES):
        rule = AGGREGATIONS[mode]
        denominator, per_response_mean, count_tokens = surrogate.aggregation(index, None, 9, 4)
        assert per_response_mean == rule.per_response_mean
        assert count_tokens == (rule.count == "tokens")
        if not count_tokens:
            count = {"responses": 4, "one": 1}[rule.count]
            assert denominator == count * (9 if rule.times_max_length else 1)


def test_a_new_row_reaches_every_backend(monkeypatch):
    """A mode appended to the table is read by the reference and the Triton host code,
    and changes the C++ header and fingerprint (a stale build is refused by the cpp
    backend's fingerprint check, cpp_backend.py)."""
    rows = dict(AGGREGATIONS, **{"seq-sum-norm-mean": aggregation_table.Aggregation(
        count="responses", per_response_mean=True, times_max_length=True)})
    monkeypatch.setattr(aggregation_table, "AGGREGATIONS", rows)
    monkeypatch.setattr(aggregation_table, "AGG_MODES", tuple(rows))
    header = cpp_constants.header(cpp_constants.installed)
    assert "kAggCount = 6" in header and "{1, true, true}" in header
    assert json.loads(json.dumps(cpp_constants.fingerprint(cpp_constants.installed)))["aggregations"][-1] == [1, 1, 1]
    import hadw_kernels.formulas.aggregation as aggregation

    monkeypatch.setattr(aggregation, "AGGREGATIONS", rows)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss_config = LossConfig(group_size=None, normalize_std=True, loss_agg_mode="token-mean",
                             epsilon_low=0.2, epsilon_high=0.2, max_response_length=10)
    object.__setattr__(loss_config, "loss_agg_mode", "seq-sum-norm-mean")
    layout = TokenLayout.padded(2, 3, torch.device("cpu"))
    weights = agg_weights(mask.reshape(-1), layout, loss_config)
    assert weights.tolist() == pytest.approx([1 / (2 * 10 * 2), 1 / (1 * 10 * 2)])


def test_an_unknown_count_is_refused():
    with pytest.raises(ValueError, match="aggregation counts one of"):
        aggregation_table.Aggregation(count="tokens-squared")
