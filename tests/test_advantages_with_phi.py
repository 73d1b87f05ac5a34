"""hadw_advantages(..., return_phi=True): the Phi it multiplied in, returned with A * Phi
by the one call, so that a caller reporting Phi (the trainer's phi_mean) reads it rather
than dividing two calls' advantages (docs/math.md, section 4)."""

import pytest
import torch

from hadw_kernels import hadw_advantages, hadw_weights

REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 0.5, 0.0])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "james_stein"])
@pytest.mark.parametrize("groups", ["size", "index"])
def test_phi_comes_with_the_advantages_it_weighs(estimator, groups):
    where = dict(group_size=4) if groups == "size" else dict(group_index=torch.arange(12) % 3)
    options = dict(anchor=0.4, lambda_scale=1.3, estimator=estimator, **where)
    advantages, phi = hadw_advantages(REWARDS, return_phi=True, **options)
    assert torch.equal(advantages, hadw_advantages(REWARDS, **options))
    plain = hadw_advantages(REWARDS, estimator=estimator, **where)
    assert torch.equal(advantages, plain * phi)
    # Phi where A is 0 is lambda (sgn(0) = 0), however A came to be 0.
    assert torch.equal(phi[plain == 0], torch.full_like(phi[plain == 0], 1.3))
    assert ((phi >= 1.3 / torch.e) & (phi <= 1.3 * torch.e)).all()


def test_grpo_s_phi_is_hadw_weights():
    _, phi = hadw_advantages(REWARDS, group_size=4, anchor=0.4, lambda_scale=1.3, return_phi=True)
    assert torch.equal(phi, hadw_weights(REWARDS, 4, 0.4, lambda_scale=1.3))


def test_no_anchor_gives_a_phi_of_1():
    advantages, phi = hadw_advantages(REWARDS, group_size=4, return_phi=True)
    assert torch.equal(phi, torch.ones(12)) and torch.equal(advantages, hadw_advantages(REWARDS, group_size=4))


def test_the_trainer_reports_the_phi_it_weighed_by():
    from trainer.config import load_config
    from trainer.engine.loop import batch_advantages

    algorithm = load_config(None, []).algorithm
    advantages, figures = batch_advantages(REWARDS, 4, algorithm, 1.3, belief=0.4)
    expected, phi = hadw_advantages(REWARDS, group_size=4, anchor=0.4, lambda_scale=1.3, return_phi=True)
    assert torch.equal(advantages, expected) and figures["phi_mean"] == float(phi.mean())
