"""The difficulty anchor: tracking, the freeze trap, rules (soft, hard, Kalman), beliefs,
save/load, ranks."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hadw_kernels import DifficultyAnchor
from hadw_kernels.theory.anchor_tracking import tracking_error

BATCH = 2048  # binary rewards a rollout batch, as in SPEC section 3
SMALL_BATCH = 64  # the trainer's CPU default: 8 prompts x G = 8


def _mean_tracking_error(anchor, kind, seed, batch=BATCH):
    return tracking_error(anchor, kind, seed, batch)


@pytest.mark.parametrize("kind", ["ramp", "step"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_anchor_tracks_ramp_and_step(kind, seed):
    assert _mean_tracking_error(DifficultyAnchor(), kind, seed) < 0.03


def test_soft_rule_without_floor_freezes_with_a_small_gain():
    # The trap the defaults avoid: sigma_t -> 0 makes eta_t -> 0 for good.
    frozen = DifficultyAnchor(eta=1.0, eta_min=0.0)
    assert _mean_tracking_error(frozen, "ramp", 0) > 0.1
    assert frozen.eta_t < 0.01


@pytest.mark.parametrize("batch, bound", [(SMALL_BATCH, 0.03), (BATCH, 0.008)])
@pytest.mark.parametrize("kind", ["ramp", "step"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kalman_anchor_tracks_ramp_and_step(batch, bound, kind, seed):
    assert _mean_tracking_error(DifficultyAnchor("kalman"), kind, seed, batch) < bound


def _seed_mean(make, batch):
    return sum(_mean_tracking_error(make(), kind, seed, batch) for kind in ("ramp", "step") for seed in (0, 1, 2)) / 6


def test_kalman_rule_against_soft_and_hard():
    """Why the trainer's default anchor is the Kalman rule: at 64 rewards a batch the
    soft rule's gain is pinned at 1 (its error is the batch noise, ~0.05) and the filter
    halves it; at 2048 the filter beats both the soft and the authors' hard rule."""
    kalman, soft, hard = (lambda: DifficultyAnchor("kalman")), DifficultyAnchor, DifficultyAnchor.authors_code
    assert _seed_mean(kalman, SMALL_BATCH) < 0.5 * _seed_mean(soft, SMALL_BATCH)
    assert _seed_mean(kalman, BATCH) < min(_seed_mean(soft, BATCH), _seed_mean(hard, BATCH))


def test_kalman_gain_smooths_small_batches_and_trusts_large_ones():
    gains = {}
    for batch in (SMALL_BATCH, BATCH):
        anchor = DifficultyAnchor("kalman")
        generator = torch.Generator().manual_seed(0)
        for _ in range(50):
            anchor.update(torch.bernoulli(torch.full((batch,), 0.4), generator=generator))
        gains[batch] = anchor.eta_t
    assert gains[SMALL_BATCH] < 0.3 and gains[SMALL_BATCH] < gains[BATCH] / 2


def test_kalman_update_formula():
    anchor = DifficultyAnchor("kalman", window=2, process_noise_min=1e-4)
    anchor.observe(0.5, count=100, variance=0.25)  # C_1+ = y_1, P_1+ = R_1
    assert (anchor.posterior, anchor.variance, anchor.eta_t) == (0.5, 0.0025, 1.0)
    anchor.observe(0.6, count=100, variance=0.24)
    noise, innovation = 0.0024, 0.1
    process = innovation**2 - 0.0025 - noise  # one innovation in the window
    gain = (0.0025 + process) / (0.0025 + process + noise)
    assert anchor.prior == 0.5
    assert anchor.eta_t == pytest.approx(gain)
    assert anchor.posterior == pytest.approx(0.5 + gain * innovation)
    assert anchor.variance == pytest.approx((1 - gain) * (0.0025 + process))
    assert anchor.sigma_t == pytest.approx(anchor.variance**0.5)


def test_kalman_rule_reads_the_batch_size_and_variance_from_update():
    anchor = DifficultyAnchor("kalman")
    anchor.update(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # sample variance of [1, 0, 0, 0] is 0.25; R = 0.25 / 4
    assert anchor.variance == pytest.approx(0.25 / 4)
    anchor.update(torch.tensor([0.2, 0.4, 0.6, 0.8]))  # non-binary rewards: their variance
    assert anchor.observation == pytest.approx(0.5)
    with pytest.raises(ValueError, match="count"):
        DifficultyAnchor("kalman").observe(0.5)


def test_kalman_rule_does_not_take_a_batch_of_equal_rewards_as_noiseless():
    anchor = DifficultyAnchor("kalman")
    anchor.observe(0.3, count=64)
    anchor.observe(0.0, count=64, variance=0.0)  # every response wrong
    assert 0 < anchor.eta_t < 1 and anchor.posterior > 0


def test_hard_rule_is_mean_of_last_h_observations():
    anchor = DifficultyAnchor("hard", window=3)
    observations = [0.1, 0.5, 0.3, 0.9, 0.2]
    for step, y in enumerate(observations):
        anchor.observe(y)
        recent = observations[max(0, step - 2): step + 1]
        assert anchor.posterior == pytest.approx(sum(recent) / len(recent))


def test_prior_and_posterior_beliefs():
    paper, authors = DifficultyAnchor(), DifficultyAnchor(belief="posterior")
    assert paper.update(torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.25  # C_1- = y_1
    assert authors.update(torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.25
    assert paper.update(torch.tensor([1.0, 1.0, 1.0, 0.0])) == 0.25  # prior: y_2 not yet in
    assert authors.update(torch.tensor([1.0, 1.0, 1.0, 0.0])) == 0.5  # running mean in warm-up


def test_initial_value_is_the_first_prior():
    anchor = DifficultyAnchor(initial=0.5)
    assert anchor.update(torch.tensor([0.0, 0.0])) == 0.5


def test_soft_update_formula_after_warm_up():
    anchor = DifficultyAnchor(eta=2.0, window=3, eta_min=0.0)
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
                                    dict(process_noise_min=0.0), dict(process_noise_min=float("inf")),
                                    dict(eta_min=2.0), dict(window=0), dict(initial=float("nan"))])
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises(ValueError):
        DifficultyAnchor(**kwargs)


def test_empty_or_non_finite_batch_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        DifficultyAnchor().update(torch.tensor([]))
    with pytest.raises(ValueError, match="finite"):
        DifficultyAnchor().update(torch.tensor([1.0, float("nan")]))


def _rank_main(rank, world_size, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        anchor = DifficultyAnchor()
        # Unequal shards: the global mean is (3 + 1) / (4 + 2), not the mean of 0.75 and 0.5.
        rewards = torch.tensor([1.0, 1.0, 1.0, 0.0]) if rank == 0 else torch.tensor([1.0, 0.0])
        results[rank] = anchor.update(rewards)
    finally:
        dist.destroy_process_group()


def test_observation_is_all_reduced_across_ranks():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, port, results), nprocs=2, join=True)
    assert results[0] == results[1] == pytest.approx(4 / 6)


# --- input (issue 12, item 8) -------------------------------------------------------------


def test_update_takes_a_list_of_rewards():
    anchor = DifficultyAnchor()
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
        (dict(process_noise_min=float("inf")), "process_noise_min"),
    ],
)
def test_bad_settings_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        DifficultyAnchor(**options)


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
