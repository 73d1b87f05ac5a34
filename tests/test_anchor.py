"""The difficulty anchor: tracking, the freeze trap, rules, beliefs, save/load, ranks."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hadw_kernels import DifficultyAnchor

BATCH = 2048  # binary rewards a rollout batch, as in SPEC section 3
STEPS = 300


def _accuracy(kind, step):
    if kind == "ramp":
        return 0.3 + 0.4 * step / (STEPS - 1)
    return 0.3 if step < STEPS // 2 else 0.7


def _mean_tracking_error(anchor, kind, seed):
    generator = torch.Generator().manual_seed(seed)
    errors = []
    for step in range(STEPS):
        accuracy = _accuracy(kind, step)
        belief = anchor.update(torch.bernoulli(torch.full((BATCH,), accuracy), generator=generator))
        if step >= anchor.window:  # after warm-up
            errors.append(abs(belief - accuracy))
    return sum(errors) / len(errors)


@pytest.mark.parametrize("kind", ["ramp", "step"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_anchor_tracks_ramp_and_step(kind, seed):
    assert _mean_tracking_error(DifficultyAnchor(), kind, seed) < 0.03


def test_soft_rule_without_floor_freezes_with_a_small_gain():
    # The trap the defaults avoid: sigma_t -> 0 makes eta_t -> 0 for good.
    frozen = DifficultyAnchor(eta=1.0, eta_min=0.0)
    assert _mean_tracking_error(frozen, "ramp", 0) > 0.1
    assert frozen.eta_t < 0.01


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


def test_save_and_load_mid_run_gives_identical_beliefs(tmp_path):
    generator = torch.Generator().manual_seed(3)
    batches = [torch.bernoulli(torch.full((64,), 0.2 + 0.002 * t), generator=generator) for t in range(40)]
    straight = DifficultyAnchor()
    beliefs = [straight.update(b) for b in batches]

    first = DifficultyAnchor()
    for b in batches[:17]:
        first.update(b)
    torch.save(first.state_dict(), tmp_path / "anchor.pt")
    resumed = DifficultyAnchor()
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


@pytest.mark.parametrize("kwargs", [dict(rule="kalman"), dict(belief="mid"), dict(eta=-1.0),
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
