"""The difficulty anchor: tracking, the freeze trap, rules (soft, hard, kalman: the IMM
bank of docs/math.md), beliefs, save/load and its checks, ranks."""

import json
import math
from pathlib import Path

import pytest
import torch
from gloo_ranks import on_ranks

from hadw_kernels import DifficultyAnchor, fused_hadw_grpo_loss, hadw_advantages, hadw_weights
from hadw_kernels.advantage.anchor import DEFAULT_RULE, checked_rewards
from hadw_kernels.config.loss_config import DEFAULT_LAMBDA_SCALE
from hadw_kernels.theory.anchor_tracking import SEEDS, tracking_error

BATCH = 2048  # binary rewards a rollout batch, as in the paper (docs/math.md section 3)
SMALL_BATCH = 64  # the trainer's CPU default: 8 prompts x G = 8


def _mean_tracking_error(anchor, kind, seed, batch=BATCH):
    return tracking_error(anchor, kind, seed, batch)


@pytest.mark.parametrize("kind", ["ramp", "step"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_soft_rule_defaults_track_ramp_and_step(kind, seed):
    assert _mean_tracking_error(DifficultyAnchor("soft"), kind, seed) < 0.03


def test_the_default_rule_is_the_kalman_rule():
    """One default, the rule that tracks best (docs/math.md, section 3), declared once: TRL's and
    verl's defaults and the trainer's preset are held to it by their own tests."""
    assert DEFAULT_RULE == "kalman"
    assert DifficultyAnchor().rule == DEFAULT_RULE


def test_soft_rule_without_floor_freezes_with_a_small_gain():
    # The trap the defaults avoid: sigma_t -> 0 makes eta_t -> 0 for good.
    frozen = DifficultyAnchor("soft", eta=1.0, eta_min=0.0)
    assert _mean_tracking_error(frozen, "ramp", 0) > 0.1
    assert frozen.eta_t < 0.01


@pytest.mark.parametrize("batch, bound", [(SMALL_BATCH, 0.02), (BATCH, 0.005)])
@pytest.mark.parametrize("kind", ["ramp", "step"])
def test_kalman_anchor_tracks_ramp_and_step(batch, bound, kind):
    assert _seed_mean(lambda: DifficultyAnchor("kalman"), batch, kinds=(kind,)) < bound


def _seed_mean(make, batch, kinds=("ramp", "step")):
    errors = [_mean_tracking_error(make(), kind, seed, batch) for kind in kinds for seed in SEEDS]
    return sum(errors) / len(errors)


@pytest.mark.parametrize("belief", ["prior", "posterior"])
@pytest.mark.parametrize("kind", ["ramp", "step"])
def test_kalman_rule_beats_the_soft_rule_and_a_10_batch_window(kind, belief):
    """Why the trainer's default anchor is the kalman rule (docs/math.md section 3's protocol: 3
    seeds, binary rewards, mean |C_t - p_t| after batch 20): at 64 rewards a batch it
    tracks a ramp and a step closer than the soft rule and than a 10-batch window."""
    kalman = _seed_mean(lambda: DifficultyAnchor("kalman", belief=belief), SMALL_BATCH, (kind,))
    soft = _seed_mean(lambda: DifficultyAnchor("soft"), SMALL_BATCH, (kind,))
    window = _seed_mean(DifficultyAnchor.authors_code, SMALL_BATCH, (kind,))
    assert kalman < 0.85 * min(soft, window)


def test_kalman_gain_smooths_small_batches_and_trusts_large_ones():
    """From the same belief, the same surprise moves it further when it is the mean of
    more rewards (R_t = c(1 - c) / B_t is smaller)."""
    anchor = DifficultyAnchor("kalman")
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        anchor.update(torch.bernoulli(torch.full((SMALL_BATCH,), 0.4), generator=generator))
    gains = {}
    for batch in (8, SMALL_BATCH, BATCH):
        resumed = DifficultyAnchor("kalman")
        resumed.load_state_dict(anchor.state_dict())
        resumed.observe(resumed.posterior + 0.05, count=batch)
        gains[batch] = resumed.eta_t
    assert 0 < gains[8] < gains[SMALL_BATCH] < gains[BATCH] < 1


# --- the kalman rule at the edges of [0, 1] -------------------------------------------------

HELD = 200  # batches an accuracy of 0 or 1 is held


def _edge_accuracies(kind):
    """The true accuracy per batch: ramps of 60 batches to 1 and to 0 then held, 0 or 1
    from the start, or all-0 and all-1 batches in turn."""
    if kind == "ramp to 1":
        return [min(1.0, 0.3 + 0.7 * t / 59) for t in range(60 + HELD)]
    if kind == "ramp to 0":
        return [max(0.0, 0.9 - 0.9 * t / 59) for t in range(60 + HELD)]
    if kind in ("constant 0", "constant 1"):
        return [float(kind[-1])] * HELD
    return [float(t % 2) for t in range(HELD)]


# Every group mean 0, 1/8, ..., 1: Phi's exponent |p_hat - C| takes all its extremes.
_PHI_PROBE = torch.tensor([[1.0] * k + [0.0] * (8 - k) for k in range(9)], dtype=torch.float64).reshape(-1)


@pytest.mark.parametrize("kind", ["ramp to 1", "ramp to 0", "constant 0", "constant 1", "alternating"])
@pytest.mark.parametrize("batch", [1, 2, 8, 64, 512, 4096])
def test_kalman_beliefs_and_phi_stay_in_range_at_the_edges(kind, batch):
    """An accuracy that reaches 0 or 1 (a task mastered or lost) keeps every belief, prior
    and posterior, in [0, 1] and every Phi in [lambda / e, lambda e], and so an anchor the
    loss accepts. The bank's own levels stay in [0, 1] (docs/math.md, "The kalman rule",
    step 3), so no belief is a clipped divergence; the state at the edge loads again."""
    generator = torch.Generator().manual_seed(batch)
    anchor = DifficultyAnchor("kalman")
    low, high = DEFAULT_LAMBDA_SCALE / math.e, DEFAULT_LAMBDA_SCALE * math.e
    for accuracy in _edge_accuracies(kind):
        anchor.update(torch.bernoulli(torch.full((batch,), accuracy), generator=generator))
        levels = [level for level, _ in anchor.state_dict()["bank"]["x"]] if anchor.step > 1 else []
        assert all(0.0 <= level <= 1.0 for level in levels), (anchor.step, levels)
        for belief in (anchor.prior, anchor.posterior):
            assert math.isfinite(belief) and 0.0 <= belief <= 1.0, (anchor.step, anchor.prior, anchor.posterior)
            phi = hadw_weights(_PHI_PROBE, 8, belief)
            assert bool(torch.isfinite(phi).all()) and low <= phi.min().item() <= phi.max().item() <= high
            hadw_advantages(_PHI_PROBE, group_size=8, anchor=belief)  # refuses a belief outside [0, 1]
    resumed = DifficultyAnchor("kalman")
    resumed.load_state_dict(json.loads(json.dumps(anchor.state_dict())))
    last = torch.full((batch,), _edge_accuracies(kind)[-1])
    assert resumed.update(last) == anchor.update(last)


def test_kalman_trend_models_do_not_predict_past_an_accuracy_of_1():
    """The issue's run: 64 rewards a batch, accuracy 0.3 -> 1.0 over 60 batches, then
    held. The trend models' slope carried their prediction, and with it the belief, to
    1.0235; each prediction past the bound is now put on it."""
    generator = torch.Generator().manual_seed(0)
    anchor = DifficultyAnchor("kalman")
    beliefs = [anchor.update(torch.bernoulli(torch.full((SMALL_BATCH,), accuracy), generator=generator))
               for accuracy in _edge_accuracies("ramp to 1")]
    assert max(beliefs) <= 1.0 and beliefs[-1] == pytest.approx(1.0, abs=1e-6)
    slopes = [slope for _, slope in anchor.state_dict()["bank"]["x"][:6]]
    assert max(slopes) > 0  # a trend model still rising: its prediction is the one projected


# --- the kalman rule against the equations -----------------------------------------------

GOLDEN = json.loads((Path(__file__).parent / "data" / "imm_anchor_golden.json").read_text())


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda case: case["case"])
def test_kalman_rule_agrees_with_the_golden_transcription(case):
    """200 steps from an independent float64 transcription of the bank: prior, posterior
    and the effective gain eta agree to 1e-9."""
    prior, posterior = DifficultyAnchor("kalman"), DifficultyAnchor("kalman", belief="posterior")
    for step in case["steps"]:
        rewards = torch.tensor(step["rewards"], dtype=torch.float64)
        assert prior.update(rewards) == pytest.approx(step["prior"], abs=1e-9, rel=0)
        assert posterior.update(rewards) == pytest.approx(step["posterior"], abs=1e-9, rel=0)
        assert prior.figures()["anchor/prior"] == pytest.approx(step["prior"], abs=1e-9, rel=0)
        assert prior.figures()["anchor/posterior"] == pytest.approx(step["posterior"], abs=1e-9, rel=0)
        if step["eta"] is None:
            assert prior.eta_t is None
        else:
            assert prior.figures()["anchor/eta"] == pytest.approx(step["eta"], abs=1e-9, rel=0)


def _imm_by_hand(batches):
    """The bank's equations (docs/math.md), one model and one entry at a time, in plain
    Python: yields (prior, posterior, eta) per batch of (mean, unbiased variance, count)."""
    trend_q = [10.0**k for k in range(-10, -4)]
    level_q = [10.0**k for k in range(-9, 0)]
    models = [("trend", q) for q in trend_q] + [("level", q) for q in level_q]
    M, eps, lam = len(models), 0.005, 0.9
    pi = [[1 - eps if i == j else eps / (M - 1) for j in range(M)] for i in range(M)]

    def F(j):
        return [[1.0, 1.0], [0.0, 1.0]] if models[j][0] == "trend" else [[1.0, 0.0], [0.0, 0.0]]

    def Q(j):
        kind, q = models[j]
        return [[q / 3, q / 2], [q / 2, q]] if kind == "trend" else [[q, 0.0], [0.0, 0.0]]

    def matmul(a, b):
        return [[sum(a[r][k] * b[k][c] for k in range(2)) for c in range(2)] for r in range(2)]

    def transpose(a):
        return [[a[0][0], a[1][0]], [a[0][1], a[1][1]]]

    s2_sum = bern_sum = 0.0
    mu = x = P = None
    for y, s2, B in batches:
        s2_sum = lam * s2_sum + s2
        bern_sum = lam * bern_sum + y * (1 - y)
        phi = 1.0 if bern_sum == 0 else min(max(s2_sum / bern_sum, 1e-3), 1.0)

        def R(c, B=B, phi=phi):
            c = min(max(c, 0.5 / (B + 1)), 1 - 0.5 / (B + 1))
            return phi * c * (1 - c) / B

        if mu is None:
            mu = [1.0 / M] * M
            x = [[y, 0.0] for _ in range(M)]
            P = [[[R(y), 0.0], [0.0, 1e-4 if models[j][0] == "trend" else 0.0]] for j in range(M)]
            yield y, y, None
            continue
        c = [sum(pi[i][j] * mu[i] for i in range(M)) for j in range(M)]
        xp, Pp = [], []
        for j in range(M):
            w = [pi[i][j] * mu[i] / c[j] for i in range(M)]
            x0 = [sum(w[i] * x[i][a] for i in range(M)) for a in range(2)]
            P0 = [[sum(w[i] * (P[i][a][b] + (x[i][a] - x0[a]) * (x[i][b] - x0[b])) for i in range(M))
                   for b in range(2)] for a in range(2)]
            f = F(j)
            xp.append([f[a][0] * x0[0] + f[a][1] * x0[1] for a in range(2)])
            FPF = matmul(matmul(f, P0), transpose(f))
            Pp.append([[FPF[a][b] + Q(j)[a][b] for b in range(2)] for a in range(2)])
        prior = sum(c[j] * xp[j][0] for j in range(M))
        r = R(prior)
        likelihoods = []
        for j in range(M):
            nu = y - xp[j][0]
            S = Pp[j][0][0] + r
            K = [Pp[j][0][0] / S, Pp[j][1][0] / S]
            x[j] = [xp[j][0] + K[0] * nu, xp[j][1] + K[1] * nu]
            P[j] = [[Pp[j][a][b] - K[a] * Pp[j][0][b] for b in range(2)] for a in range(2)]
            likelihoods.append(c[j] * math.exp(-nu * nu / (2 * S)) / math.sqrt(2 * math.pi * S))
        total = sum(likelihoods)
        mu = [max(value / total, 1e-12) for value in likelihoods]
        posterior = sum(mu[j] * x[j][0] for j in range(M))
        yield prior, posterior, (posterior - prior) / (y - prior) if y != prior else None


def test_kalman_rule_follows_the_equations_step_by_step():
    generator = torch.Generator().manual_seed(11)
    batches = []
    for t in range(60):
        count = (8, 64, 16)[t % 3]
        if t < 30:  # binary rewards on a ramp, then partial credit after a drop
            rewards = torch.bernoulli(torch.full((count,), 0.2 + 0.02 * t), generator=generator)
        else:
            rewards = torch.rand(count, generator=generator, dtype=torch.float64) * 0.6
        batches.append(rewards.double())
    anchor = DifficultyAnchor("kalman")
    by_hand = _imm_by_hand([(b.mean().item(), b.var().item(), b.numel()) for b in batches])
    for rewards, (prior, posterior, eta) in zip(batches, by_hand):
        assert anchor.update(rewards) == pytest.approx(prior, abs=1e-12, rel=0)
        assert anchor.posterior == pytest.approx(posterior, abs=1e-12, rel=0)
        if eta is not None:
            assert anchor.eta_t == pytest.approx(eta, abs=1e-9, rel=0)
    bank = anchor.state_dict()["bank"]
    assert len(bank["mu"]) == 15 and len(bank["x"]) == 15 and len(bank["P"]) == 15
    assert sum(bank["mu"]) == pytest.approx(1.0)


def test_kalman_prior_is_the_banks_prediction_not_the_last_posterior():
    anchor = DifficultyAnchor("kalman")
    for y in (0.2, 0.25, 0.3, 0.35, 0.4):  # a clean ramp: the trend models predict ahead
        anchor.observe(y, count=2048)
    last_posterior = anchor.posterior
    anchor.observe(0.45, count=2048)
    assert anchor.prior > last_posterior


def test_kalman_rule_reads_the_batch_size_and_variance_from_update():
    anchor = DifficultyAnchor("kalman")
    anchor.update(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # binary rewards: phi = 1 and R_1 = y(1 - y) / B = 0.1875 / 4 is every level's variance
    assert anchor.state_dict()["bank"]["P"][0][0] == pytest.approx(0.1875 / 4)
    partial = DifficultyAnchor("kalman")
    partial.update(torch.tensor([0.4, 0.5, 0.5, 0.6]))  # partial credit: variance 1/150, not 0.25
    assert partial.state_dict()["bank"]["P"][0][0] == pytest.approx((0.02 / 3) / 4)
    with pytest.raises(ValueError, match="count"):
        DifficultyAnchor("kalman").observe(0.5)


def test_kalman_rule_does_not_take_a_batch_of_equal_rewards_as_noiseless():
    anchor = DifficultyAnchor("kalman")
    anchor.observe(0.3, count=64)
    anchor.observe(0.0, count=64, variance=0.0)  # every response wrong
    assert 0 < anchor.eta_t < 1 and anchor.posterior > 0
    first = DifficultyAnchor("kalman")
    first.observe(0.0, count=8, variance=0.0)  # even as the first batch
    first.observe(0.25, count=8)
    assert 0 < first.eta_t < 1


def test_hard_rule_is_mean_of_last_h_observations():
    anchor = DifficultyAnchor("hard", window=3)
    observations = [0.1, 0.5, 0.3, 0.9, 0.2]
    for step, y in enumerate(observations):
        anchor.observe(y)
        recent = observations[max(0, step - 2): step + 1]
        assert anchor.posterior == pytest.approx(sum(recent) / len(recent))


def test_prior_and_posterior_beliefs():
    paper, authors = DifficultyAnchor("soft"), DifficultyAnchor("soft", belief="posterior")
    assert paper.update(torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.25  # C_1- = y_1
    assert authors.update(torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.25
    assert paper.update(torch.tensor([1.0, 1.0, 1.0, 0.0])) == 0.25  # prior: y_2 not yet in
    assert authors.update(torch.tensor([1.0, 1.0, 1.0, 0.0])) == 0.5  # running mean in warm-up


@pytest.mark.parametrize("rule", ["soft", "hard", "kalman"])
def test_initial_value_is_the_first_prior(rule):
    anchor = DifficultyAnchor(rule, initial=0.5)
    assert anchor.update(torch.tensor([0.0, 0.0])) == 0.5


def test_soft_update_formula_after_warm_up():
    anchor = DifficultyAnchor("soft", eta=2.0, window=3, eta_min=0.0)
    for y in (0.2, 0.4, 0.6):
        anchor.observe(y)
    posteriors = [0.2, 0.3, 0.4]  # running means during warm-up
    mean = sum(posteriors) / 3
    sigma = (sum((c - mean) ** 2 for c in posteriors) / 3) ** 0.5
    anchor.observe(0.8)
    assert anchor.sigma_t == pytest.approx(sigma)
    assert anchor.eta_t == pytest.approx(2.0 * sigma)
    assert anchor.posterior == pytest.approx((1 - 2.0 * sigma) * 0.4 + 2.0 * sigma * 0.8)


def test_authors_code_preset():
    anchor = DifficultyAnchor.authors_code()
    assert (anchor.rule, anchor.window, anchor.belief) == ("hard", 10, "posterior")


@pytest.mark.parametrize("rule", ["soft", "hard", "kalman"])
def test_save_and_load_mid_run_gives_identical_beliefs(tmp_path, rule):
    generator = torch.Generator().manual_seed(3)
    batches = [torch.bernoulli(torch.full((64,), 0.2 + 0.002 * t), generator=generator) for t in range(40)]
    straight = DifficultyAnchor(rule)
    beliefs = [straight.update(b) for b in batches]

    first = DifficultyAnchor(rule)
    for b in batches[:17]:
        first.update(b)
    torch.save(first.state_dict(), tmp_path / "anchor.pt")
    resumed = DifficultyAnchor(rule)
    resumed.load_state_dict(torch.load(tmp_path / "anchor.pt"))
    assert [resumed.update(b) for b in batches[17:]] == beliefs[17:]
    assert resumed.figures() == straight.figures()


def test_load_rejects_state_of_another_configuration():
    with pytest.raises(ValueError, match="saved with"):
        DifficultyAnchor("hard").load_state_dict(DifficultyAnchor().state_dict())


def test_figures_for_logging():
    anchor = DifficultyAnchor()
    anchor.update(torch.tensor([1.0, 0.0]))
    figures = anchor.figures()
    assert set(figures) == {"anchor/step", "anchor/belief", "anchor/y", "anchor/prior", "anchor/posterior", "anchor/eta", "anchor/sigma"}
    assert figures["anchor/y"] == 0.5


@pytest.mark.parametrize("kwargs", [dict(rule="median"), dict(belief="mid"), dict(eta=-1.0),
                                    dict(eta_min=2.0), dict(window=0), dict(initial=float("nan"))])
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises(ValueError):
        DifficultyAnchor(**kwargs)


def test_empty_or_non_finite_batch_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        DifficultyAnchor().update(torch.tensor([]))
    with pytest.raises(ValueError, match="finite"):
        DifficultyAnchor().update(torch.tensor([1.0, float("nan")]))


def _anchor_on_rank(rank):
    anchor = DifficultyAnchor()
    # Unequal shards: the global mean is (3 + 1) / (4 + 2), not the mean of 0.75 and 0.5.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0]) if rank == 0 else torch.tensor([1.0, 0.0])
    return anchor.update(rewards)


@pytest.mark.slow
def test_observation_is_all_reduced_across_ranks():
    results = on_ranks(_anchor_on_rank)
    assert results[0] == results[1] == pytest.approx(4 / 6)


# --- input ---------------------------------------------------------------------------------


def test_update_takes_a_list_of_rewards():
    anchor = DifficultyAnchor("soft")
    assert anchor.update([0.0, 1.0]) == pytest.approx(0.5)
    assert anchor.update((1, 1, 1, 0)) == pytest.approx(0.5)  # prior: the previous belief


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(initial=5.0), r"initial must lie in \[0, 1\]"),
        (dict(initial=True), r"initial must lie in \[0, 1\]"),
        (dict(eta=float("inf")), "eta must be finite"),
        (dict(eta=float("nan")), "eta must be finite"),
        (dict(eta_min=2.0), r"eta_min must lie in \[0, 1\]"),
    ],
)
def test_bad_settings_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        DifficultyAnchor(**options)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_a_reward_tensor_the_loss_refuses_is_refused_by_the_anchor_with_its_message(dtype):
    """One rule for the anchor and the losses: a reward tensor is floating point (an int
    tensor was folded into the belief, then refused by the loss)."""
    rewards = torch.tensor([1, 0, 1, 1]).to(dtype)
    logprobs = torch.zeros(4, 3)
    with pytest.raises(TypeError) as by_the_loss:
        fused_hadw_grpo_loss(logprobs, logprobs, rewards, torch.ones(4, 3), group_size=2, anchor=0.5)
    assert str(by_the_loss.value).startswith("rewards must be a floating-point tensor")
    for check in (checked_rewards, DifficultyAnchor("soft").update, DifficultyAnchor("kalman").update):
        with pytest.raises(TypeError) as by_the_anchor:
            check(rewards)
        assert str(by_the_anchor.value) == str(by_the_loss.value)


@pytest.mark.parametrize("rewards, match", [([0.0, 2.0], r"\[0, 1\]"), ([0.0, float("nan")], "NaN"),
                                            (["a"], "sequence of numbers")])
def test_bad_rewards_are_refused_and_change_nothing(rewards, match):
    anchor = DifficultyAnchor()
    anchor.update(torch.tensor([0.0, 1.0, 1.0, 1.0]))
    before = anchor.state_dict()
    with pytest.raises((ValueError, TypeError), match=match):
        anchor.update(rewards)
    assert anchor.state_dict() == before


@pytest.mark.parametrize("damage", ["missing", "unknown", "prior", "step"])
def test_a_bad_state_is_refused_whole(damage):
    source = DifficultyAnchor()
    for value in (0.25, 0.5, 0.75):
        source.update(torch.tensor([value, value]))
    state = source.state_dict()
    if damage == "missing":
        del state["posteriors"]
    elif damage == "unknown":
        state["extra"] = 1
    elif damage == "prior":
        state["prior"] = float("nan")
    else:
        state["step"] = -3
    target = DifficultyAnchor()
    target.update(torch.tensor([1.0, 1.0]))
    before = target.state_dict()
    with pytest.raises(ValueError):
        target.load_state_dict(state)
    assert target.state_dict() == before


# --- the saved state: versioned, checked whole before any of it is assigned ---------------


def _v1_state(rule):
    """A state_dict() as the library wrote it before the kalman rule became the IMM bank
    (no version; the single filter's variance and innovations)."""
    return {
        "config": {"rule": rule, "eta": 50.0, "window": 10, "eta_min": 0.05, "process_noise_min": 1e-5,
                   "belief": "prior", "initial": None},
        "step": 2, "prior": 0.25, "posterior": 0.375, "observation": 0.5, "eta_t": 0.5, "sigma_t": None,
        "observations": [0.25, 0.5], "posteriors": [0.25, 0.375], "warmup_sum": 0.75,
        "variance": 0.001 if rule == "kalman" else None, "innovations": [0.01] if rule == "kalman" else [],
    }


def test_the_pre_imm_kalman_state_is_refused_with_a_clear_message():
    anchor = DifficultyAnchor("kalman")
    anchor.update(torch.tensor([1.0, 0.0]))
    before = anchor.state_dict()
    with pytest.raises(ValueError, match="pre-IMM kalman state"):
        anchor.load_state_dict(_v1_state("kalman"))
    assert anchor.state_dict() == before


def test_a_soft_rule_state_from_before_the_version_still_loads():
    anchor = DifficultyAnchor("soft")
    anchor.load_state_dict(_v1_state("soft"))
    assert (anchor.step, anchor.posterior) == (2, 0.375)
    assert anchor.state_dict()["version"] == 2
    anchor.update(torch.tensor([1.0, 1.0]))
    assert anchor.step == 3


def test_the_kalman_state_round_trips_through_json_exactly():
    generator = torch.Generator().manual_seed(5)
    batches = [torch.bernoulli(torch.full((16,), 0.3 + 0.01 * t), generator=generator) for t in range(30)]
    straight, first = DifficultyAnchor("kalman"), DifficultyAnchor("kalman")
    beliefs = [straight.update(b) for b in batches]
    for b in batches[:12]:
        first.update(b)
    state = json.loads(json.dumps(first.state_dict()))
    assert set(state["bank"]) == {"mu", "x", "P", "variance_sum", "bernoulli_sum"}
    assert (len(state["bank"]["mu"]), len(state["bank"]["x"][0]), len(state["bank"]["P"][0])) == (15, 2, 3)
    resumed = DifficultyAnchor("kalman")
    resumed.load_state_dict(state)
    assert [resumed.update(b) for b in batches[12:]] == beliefs[12:]


def _damaged(rule, damage):
    """A JSON round-tripped state with one entry replaced: "key:json" or "bank:key=json"."""
    source = DifficultyAnchor(rule)
    for value in (0.25, 0.5, 0.75):
        source.update(torch.tensor([value, value, 1.0, 0.0]))
    state = json.loads(json.dumps(source.state_dict()))
    key, _, index = damage.partition(":")
    if key == "bank":
        bank_key, value = index.split("=")
        state["bank"][bank_key] = json.loads(value)
    else:
        state[key] = json.loads(index)
    return state


_ANY_RULE_DAMAGE = ['prior:"0.5"', 'posterior:NaN', 'observation:"x"', 'eta_t:[1]', 'sigma_t:-1.0', 'step:1.5',
                    'step:true', 'observations:"abc"', 'observations:[0.1, "a"]', 'posteriors:[1e400]',
                    'warmup_sum:"0"', 'version:1', 'config:[]']


@pytest.mark.parametrize("rule", ["soft", "hard", "kalman"])
@pytest.mark.parametrize("damage", _ANY_RULE_DAMAGE)
def test_a_wrongly_typed_or_out_of_range_state_is_refused_at_load_for_every_rule(rule, damage):
    state = _damaged(rule, damage)
    target = DifficultyAnchor(rule)
    target.update(torch.tensor([1.0, 1.0, 0.0]))
    before = target.state_dict()
    with pytest.raises((ValueError, TypeError)):
        target.load_state_dict(state)
    assert target.state_dict() == before
    target.update(torch.tensor([1.0, 0.0]))  # and the anchor still works


@pytest.mark.parametrize("damage", [
    'bank:mu=[0.5, 0.5]', 'bank:mu="a"', 'bank:x=[[0.1, 0.0]]', 'bank:P=null', 'bank:variance_sum="1"',
    'bank:bernoulli_sum=-1.0', 'bank:variance_sum=NaN',
])
def test_a_damaged_kalman_bank_is_refused_at_load(damage):
    state = _damaged("kalman", damage)
    target = DifficultyAnchor("kalman")
    before = target.state_dict()
    with pytest.raises((ValueError, TypeError)):
        target.load_state_dict(state)
    assert target.state_dict() == before


@pytest.mark.parametrize("entry, value, match", [
    ("x", "0.5", "bank 'x'"), ("x", float("inf"), "finite"), ("x", True, "bank 'x'"),
    ("P", -1.0, "positive semi-definite"), ("mu", 2.0, "probabilities"),
])
def test_a_bad_entry_in_the_kalman_bank_is_refused_with_a_clear_message(entry, value, match):
    source = DifficultyAnchor("kalman")
    for value_ in (0.25, 0.5):
        source.update(torch.tensor([value_, 1.0, 0.0]))
    state = source.state_dict()
    if entry == "mu":
        state["bank"]["mu"][0] = value
    else:
        state["bank"][entry][3][0] = value
    with pytest.raises(ValueError, match=match):
        DifficultyAnchor("kalman").load_state_dict(state)


_BELIEF_KEYS = ("prior", "posterior", "observation", "observations", "posteriors")


@pytest.mark.parametrize("rule, key", [(rule, key) for rule in ("soft", "hard", "kalman") for key in _BELIEF_KEYS]
                         + [("kalman", "bank levels")])
@pytest.mark.parametrize("value", [5.0, -0.5])
def test_a_state_whose_beliefs_leave_0_1_is_refused_at_load_naming_the_key(rule, key, value):
    """No update puts a belief, an observation or a level of the bank outside [0, 1]: a
    state holding one is damaged (loaded, its next belief was 5.0) and is refused."""
    source = DifficultyAnchor(rule)
    for rewards in ([0.25, 1.0, 0.0], [0.5, 1.0, 0.0], [0.75, 1.0, 0.0]):
        source.update(torch.tensor(rewards))
    state = json.loads(json.dumps(source.state_dict()))
    if key == "bank levels":
        state["bank"]["x"][3][0] = value
        match = r"bank 'x'.*levels.*\[0, 1\]"
    elif key in ("observations", "posteriors"):
        state[key][-1] = value
        match = rf"'{key}'.*\[0, 1\]"
    else:
        state[key] = value
        match = rf"'{key}'.*\[0, 1\]"
    target = DifficultyAnchor(rule)
    target.update(torch.tensor([1.0, 0.0]))
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    assert target.state_dict() == before


@pytest.mark.parametrize("rule", ["soft", "hard", "kalman"])
def test_an_observation_outside_0_1_is_refused_by_every_rule(rule):
    anchor = DifficultyAnchor(rule)
    anchor.observe(0.5, count=4)
    with pytest.raises(ValueError, match=r"observation y_t must lie in \[0, 1\]"):
        anchor.observe(1.5, count=4)
    assert anchor.step == 1


def test_a_bank_where_the_rule_has_none_is_refused():
    state = DifficultyAnchor("soft").state_dict()
    state["bank"] = DifficultyAnchor("kalman").state_dict()["bank"] or {"mu": []}
    with pytest.raises(ValueError, match="bank"):
        DifficultyAnchor("soft").load_state_dict(state)


def test_observe_takes_numpy_numbers_and_refuses_strings():
    import numpy as np

    anchor = DifficultyAnchor("kalman")
    anchor.observe(np.float32(0.25), count=np.int64(16), variance=np.float64(0.2))
    anchor.observe(0.5, count=16)
    assert anchor.step == 2 and isinstance(anchor.prior, float)
    with pytest.raises(ValueError, match="finite number"):
        anchor.observe("0.5", count=16)
    with pytest.raises(ValueError, match="count"):
        anchor.observe(0.5, count=16.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        anchor.observe(1.5, count=16)
    assert anchor.step == 2
