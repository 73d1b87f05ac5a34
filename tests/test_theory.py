"""The bias figures of paper section 2 and appendix C (hadw_kernels.theory)."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hadw_kernels.theory import (
    average_prob_baseline_above,
    baseline_bias,
    binomial_pmf,
    conditional_advantage,
    corollary2_average,
    correct_response_advantages,
    nondegenerate_probability,
    paper,
    prob_baseline_above,
    prob_baseline_below,
    sure_bias_direction,
    truncated_gaussian_baseline_bias,
)

# The paper's printed values sit 2.5e-6 to 5e-6 below the exact ones.
PAPER_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    # The Monte Carlo tensors are small; on a shared 2-core machine extra intra-op
    # threads only contend and made these tests several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("group_size", sorted(paper.AVERAGE_ABOVE_0_025))
def test_average_over_quarter_matches_paper_table(group_size):
    ours = average_prob_baseline_above(group_size, 0.0, 0.25)
    assert abs(ours - paper.AVERAGE_ABOVE_0_025[group_size]) < PAPER_TOLERANCE


@pytest.mark.parametrize("group_size", sorted(paper.AVERAGE_ABOVE_0_05))
def test_average_over_half_matches_paper_table(group_size):
    ours = average_prob_baseline_above(group_size, 0.0, 0.5)
    assert abs(ours - paper.AVERAGE_ABOVE_0_05[group_size]) < PAPER_TOLERANCE


@pytest.mark.parametrize("group_size", sorted(paper.COROLLARY2_AVERAGE))
def test_corollary2_average_matches_paper_table(group_size):
    assert abs(corollary2_average(group_size) - paper.COROLLARY2_AVERAGE[group_size]) < PAPER_TOLERANCE


def test_spec_six_decimal_values():
    assert round(average_prob_baseline_above(8, 0.0, 0.25), 6) == 0.781133
    assert round(average_prob_baseline_above(8, 0.0, 0.5), 6) == 0.640948
    assert round(corollary2_average(6), 6) == 0.781158


def test_values_that_are_exactly_one_or_a_half():
    # Corollary 3 makes the integrand 1 on all of (0, 1/G), and for G = 2 it is a step.
    assert average_prob_baseline_above(2, 0.0, 0.5) == pytest.approx(1.0, abs=1e-14)
    assert average_prob_baseline_above(4, 0.0, 0.25) == pytest.approx(1.0, abs=1e-14)
    assert corollary2_average(2) == pytest.approx(0.5, abs=1e-14)
    assert corollary2_average(3) == pytest.approx(0.75, abs=1e-14)


@pytest.mark.parametrize("group_size, low, high", [(8, 0.0, 0.25), (6, 0.1, 0.9), (32, 0.0, 0.3)])
def test_piecewise_quadrature_has_converged(group_size, low, high):
    coarse = average_prob_baseline_above(group_size, low, high, nodes_per_piece=8)
    fine = average_prob_baseline_above(group_size, low, high, nodes_per_piece=96)
    assert coarse == pytest.approx(fine, abs=1e-13)


def test_piecewise_quadrature_against_arbitrary_precision():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    group_size = 8

    def integrand(p):
        pmf = [mpmath.binomial(group_size, k) * p**k * (1 - p) ** (group_size - k) for k in range(group_size + 1)]
        first = int(mpmath.floor(group_size * p)) + 1
        return mpmath.fsum(pmf[first:group_size]) / mpmath.fsum(pmf[1:group_size])

    pieces = [mpmath.mpf(k) / group_size for k in range(3)] + [mpmath.mpf("0.25")]
    reference = sum(mpmath.quad(integrand, [a, b]) for a, b in zip(pieces, pieces[1:])) / mpmath.mpf("0.25")
    assert average_prob_baseline_above(group_size, 0.0, 0.25) == pytest.approx(float(reference), abs=1e-14)


@pytest.mark.parametrize("group_size", [2, 3, 8, 128])
def test_lemma_matches_the_binomial_sum(group_size):
    p = np.linspace(0.01, 0.99, 99)
    pmf = binomial_pmf(p, group_size)[..., 1:group_size]
    baselines = np.arange(1, group_size) / group_size
    direct = (pmf * baselines).sum(axis=-1) / pmf.sum(axis=-1) - p
    np.testing.assert_allclose(baseline_bias(p, group_size), direct, rtol=0, atol=1e-13)


@pytest.mark.parametrize("p, group_size", [(0.1, 4), (0.3, 8), (0.75, 6), (0.04, 16)])
def test_lemma_and_theorem2_match_monte_carlo(p, group_size):
    generator = torch.Generator().manual_seed(1234)
    groups = 200_000
    rewards = torch.bernoulli(torch.full((groups, group_size), p, dtype=torch.float64), generator=generator)
    correct = rewards.sum(dim=1)
    baselines = (correct[(correct >= 1) & (correct <= group_size - 1)] / group_size).numpy()
    error = baselines.std() / math.sqrt(baselines.size)
    assert abs((baselines.mean() - p) - baseline_bias(p, group_size)) < 4 * error
    epsilon = 0.05
    for measured, exact in [
        (baselines - p > epsilon, prob_baseline_above(p, group_size, epsilon)),
        (p - baselines > epsilon, prob_baseline_below(p, group_size, epsilon)),
    ]:
        frequency = measured.mean()
        error = math.sqrt(max(exact * (1 - exact), 1e-12) / baselines.size)
        assert abs(frequency - exact) < 4 * error + 1e-12


@pytest.mark.parametrize("group_size", range(2, 11))
def test_corollary3_sure_directions(group_size):
    below = np.linspace(1e-6, 1 / group_size - 1e-6, 50)
    above = 1.0 - below
    assert (sure_bias_direction(below, group_size) == 1).all()
    assert (sure_bias_direction(above, group_size) == -1).all()
    np.testing.assert_allclose(prob_baseline_above(below, group_size), 1.0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(prob_baseline_below(above, group_size), 1.0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(prob_baseline_below(below, group_size), 0.0, rtol=0, atol=0)
    np.testing.assert_allclose(prob_baseline_above(above, group_size), 0.0, rtol=0, atol=0)
    # Strictly between 1/G and (G-1)/G neither direction is sure.
    if group_size > 2:
        middle = np.linspace(1 / group_size + 1e-3, (group_size - 1) / group_size - 1e-3, 50)
        assert (sure_bias_direction(middle, group_size) == 0).all()
        assert (prob_baseline_above(middle, group_size) < 1).all()
        assert (prob_baseline_below(middle, group_size) < 1).all()


@pytest.mark.parametrize("group_size", [2, 4, 8, 32, 128])
def test_symmetry_and_sign(group_size):
    p = np.linspace(0.001, 0.499, 200)
    bias = baseline_bias(p, group_size)
    np.testing.assert_allclose(baseline_bias(1 - p, group_size), -bias, rtol=1e-12, atol=1e-15)
    assert (bias > 0).all()
    assert baseline_bias(0.5, group_size) == 0.0
    off_breakpoints = p[np.abs(p * group_size - np.round(p * group_size)) > 1e-6]
    np.testing.assert_allclose(
        prob_baseline_above(off_breakpoints, group_size),
        prob_baseline_below(1 - off_breakpoints, group_size),
        rtol=0, atol=1e-12,
    )


def test_theorem2_forms_are_complements_except_on_ties():
    p = np.array([0.13, 0.37, 0.61, 0.94])
    total = prob_baseline_above(p, 8) + prob_baseline_below(p, 8)
    np.testing.assert_allclose(total, 1.0, rtol=0, atol=1e-14)
    # At p = 1/2 the tie p_hat = p (R = 4) belongs to neither side.
    tie = binomial_pmf(0.5, 8)[4] / nondegenerate_probability(0.5, 8)
    assert prob_baseline_above(0.5, 8) + prob_baseline_below(0.5, 8) == pytest.approx(1.0 - tie, abs=1e-14)


@pytest.mark.parametrize("group_size", [2, 5, 8])
def test_conditional_advantages_average_to_zero(group_size):
    # E[A_hat | S] = 0: the correct and incorrect responses' means weigh out exactly.
    p = np.linspace(0.02, 0.98, 49)
    others = binomial_pmf(p, group_size - 1)
    correct_share = p * others[..., : group_size - 1].sum(axis=-1) / nondegenerate_probability(p, group_size)
    mean = correct_share * conditional_advantage(p, group_size, 1) + (1 - correct_share) * conditional_advantage(
        p, group_size, 0
    )
    np.testing.assert_allclose(mean, 0.0, rtol=0, atol=1e-14)


def test_correct_response_monte_carlo_matches_exact():
    p = [0.1, 0.5, 0.9]
    result = correct_response_advantages(p, 8, 20_000, seed=3)
    exact = conditional_advantage(np.array(p), 8, 1)
    assert (np.abs(result.mean["raw"] - exact) < 4 * result.standard_error["raw"]).all()
    # With anchor 1/2, Phi of a correct response is lambda * exp(1/2 - p_hat): above
    # lambda exactly when p_hat < 1/2, which is the most likely case at p = 0.1.
    assert result.mean["raw_hadw"][0] > 1.3 * result.mean["raw"][0]


@pytest.mark.parametrize("bad_p", [0.0, 1.0, -0.1])
def test_rejects_degenerate_accuracy(bad_p):
    with pytest.raises(ValueError):
        baseline_bias(bad_p, 8)


def test_rejects_bad_group_size():
    with pytest.raises(ValueError):
        average_prob_baseline_above(1, 0.0, 0.5)
    with pytest.raises(ValueError):
        average_prob_baseline_above(8, 0.5, 0.25)


def test_truncated_gaussian_bias_has_the_binary_sign_and_vanishes_without_threshold():
    # Locations mirrored about 1/2 give mirrored mean rewards.
    results = truncated_gaussian_baseline_bias([-0.2, 1.2], 0.2, 4, [0.0, 0.3], 20_000, seed=5)
    strict, loose = results[0.3], results[0.0]
    assert strict.accuracy[0] == pytest.approx(1 - strict.accuracy[1], abs=1e-12)
    assert strict.bias[0] > 4 * strict.standard_error[0]
    assert strict.bias[1] < -4 * strict.standard_error[1]
    # Continuous rewards are never all equal, so with sigma = 0 every group updates and
    # nothing is selected.
    assert (loose.update_probability == 1.0).all()
    assert (np.abs(loose.bias) < 4 * loose.standard_error).all()


@pytest.mark.slow
def test_command_runs_end_to_end(tmp_path):
    command = [
        sys.executable, "-m", "hadw_kernels.theory", "--out", str(tmp_path),
        "--groups", "2000", "--nonbinary-groups", "500", "--spread-thresholds", "0.2",
    ]
    finished = subprocess.run(
        command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    assert "0.781133320993" in finished.stdout
    assert "0.640948320471" in finished.stdout
    assert "0.781157731010" in finished.stdout
    for name in ("bias_vs_p.png", "monte_carlo_advantage.png", "nonbinary_bias.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_go_to_the_checkout_not_the_working_directory(tmp_path, monkeypatch, capsys):
    """Without --out the figures go to the source checkout's docs/figures from any working
    directory; where there is none (an installed package), --out is required."""
    from hadw_kernels.theory import __main__ as command

    checkout = tmp_path / "checkout" / "docs" / "figures"
    checkout.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(command, "CHECKOUT_FIGURES", checkout)
    command.main(["--groups", "200", "--nonbinary-groups", "100", "--spread-thresholds", "0.2"])
    assert sorted(path.name for path in checkout.iterdir()) == [
        "bias_vs_p.png", "monte_carlo_advantage.png", "nonbinary_bias.png"]
    assert list(elsewhere.iterdir()) == []
    monkeypatch.setattr(command, "CHECKOUT_FIGURES", tmp_path / "installed" / "docs" / "figures")
    with pytest.raises(SystemExit):
        command.main(["--groups", "200"])
    assert "--out" in capsys.readouterr().err
