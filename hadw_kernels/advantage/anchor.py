"""The evolving difficulty anchor C_t (paper section 3.1 and appendix F; docs/math.md section 3).

The anchor is a belief about the model's accuracy that lives across rollout batches.
Update it once per rollout batch (not per mini-batch or PPO epoch) with that batch's
rewards; :meth:`DifficultyAnchor.update` returns the belief the HA-DW weights use.

The soft rule has a trap the paper does not mention: eta_t = eta * sigma_t, and sigma_t
is the spread of the recent beliefs, so once the beliefs stop moving eta_t -> 0 and they
never move again. A large ``eta`` and the floor ``eta_min`` keep the anchor tracking;
the defaults were chosen by simulating a ramp and a step of accuracy (see
``tests/test_anchor.py`` and the README). They were chosen at 2048 rewards a batch: at
64, eta_t sits at its cap of 1 and the belief is the previous batch's noisy mean.

The Kalman rule is an interacting-multiple-model (IMM) bank of Kalman filters on the
state (level, slope) of the accuracy, mixed by how well each predicted the batches
(docs/math.md, "The kalman rule"). y_t is a mean of B_t rewards, so its noise variance
is known (R_t = phi_t c(1 - c) / B_t); what is not known is how the accuracy moves, so
the bank holds trend models (the accuracy drifts at a slope) and level models (it jumps
or wanders), each with a fixed process noise on a grid of decades, and the evidence
(each model's likelihood of the innovation) decides which of them the belief follows.
The level is an accuracy: a prediction that a trend carries past 0 or 1 is put on the
bound, so every level, and every belief, stays in [0, 1] (docs/math.md, "The kalman
rule": the bounds).
The update is vectorised over the models with small float64 numpy arrays.
``python -m hadw_kernels.theory.anchor_tracking`` measures every rule's tracking error.
"""

from __future__ import annotations

import math
import numbers
from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from .. import distributed
from ..checks.arguments import require_float
from .anchor_state import STATE_VERSION, checked_state, is_number

RULES = ("soft", "hard", "kalman")
# The one default rule, read by DifficultyAnchor, TRL's HADWGRPOConfig and verl's
# algorithm.hadw.anchor (the trainer's default preset is the same rule): the kalman rule
# tracks closest at every batch size measured (docs/math.md, section 3).
DEFAULT_RULE = "kalman"
BELIEFS = ("prior", "posterior")

# Chosen by simulation (2048 binary rewards a batch, ramp 0.3->0.7 over 300 steps and a
# step 0.3->0.7): both tracked within 0.03 on average after warm-up.
DEFAULT_ETA = 50.0
DEFAULT_WINDOW = 10
DEFAULT_ETA_MIN = 0.05

# The IMM bank of the kalman rule (docs/math.md, "The kalman rule"): fixed grids, one
# model per decade of process noise, none tuned to a trajectory.
TREND_PROCESS_NOISE = tuple(10.0**k for k in range(-10, -4))  # qs: 1e-10 .. 1e-5
LEVEL_PROCESS_NOISE = tuple(10.0**k for k in range(-9, 0))  # ql: 1e-9 .. 1e-1
SWITCH_PROBABILITY = 0.005  # eps: the chance a batch switches from one model to another
PHI_DECAY = 0.9  # lam: the forgetting factor of the pooled reward-variance ratio phi
PHI_MIN = 1e-3
SLOPE_PRIOR_VARIANCE = 1e-4  # the trend models' first slope variance
MODEL_PROBABILITY_FLOOR = 1e-12  # keeps every model able to come back


def _bank() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The bank's transition matrices F (M x 2 x 2), process noises Q (M x 2 x 2),
    switching matrix pi (M x M, pi[i, j] = P(model j now | model i before)) and the
    mask of trend models (M)."""
    trend, level = len(TREND_PROCESS_NOISE), len(LEVEL_PROCESS_NOISE)
    models = trend + level
    transition = np.zeros((models, 2, 2))
    transition[:trend] = [[1.0, 1.0], [0.0, 1.0]]  # level += slope; slope kept
    transition[trend:] = [[1.0, 0.0], [0.0, 0.0]]  # level kept; no slope
    noise = np.zeros((models, 2, 2))
    # An integrated random walk: a slope noise qs per batch, integrated over one batch.
    noise[:trend] = np.asarray(TREND_PROCESS_NOISE)[:, None, None] * np.array([[1 / 3, 1 / 2], [1 / 2, 1.0]])
    noise[trend:, 0, 0] = LEVEL_PROCESS_NOISE
    switching = np.full((models, models), SWITCH_PROBABILITY / (models - 1))
    np.fill_diagonal(switching, 1.0 - SWITCH_PROBABILITY)
    is_trend = np.arange(models) < trend
    return transition, noise, switching, is_trend


_TRANSITION, _PROCESS_NOISE, _SWITCHING, _IS_TREND = _bank()
MODELS = len(_IS_TREND)


def _level_in_bounds(x: np.ndarray, P: np.ndarray) -> np.ndarray:
    """The predicted states x (M x 2) with each level in [0, 1] (docs/math.md, "The
    kalman rule", the bounds). A level that a trend model's slope carried past 0 or 1 is
    put on the bound: the most probable state under N(x_j, P_j) whose level is in
    [0, 1], whose slope is the regression on the level, d + P10 / P00 (bound - l).
    Inside [0, 1] the state is unchanged, bit for bit. P is kept (P00 > 0: every model
    has level noise)."""
    bounded = np.clip(x[:, 0], 0.0, 1.0)
    x = x.copy()
    x[:, 1] += P[:, 1, 0] / P[:, 0, 0] * (bounded - x[:, 0])
    x[:, 0] = bounded
    return x


def _mixture_level(weights: np.ndarray, levels: np.ndarray) -> float:
    """A belief of the bank, sum_j w_j l_j, over levels in [0, 1]. The weights sum to 1
    but for the floor on the model probabilities (at most MODELS x 1e-12 over) and
    rounding, which are all the clip can remove."""
    return min(max(float(weights @ levels), 0.0), 1.0)


class DifficultyAnchor:
    """Tracks C_t across rollout batches.

    Args:
        rule: ``"kalman"`` (the default, ``DEFAULT_RULE``: an IMM bank of Kalman filters
            on the accuracy's level and slope, with the observation noise of a mean of
            B_t rewards: docs/math.md), ``"soft"`` (the paper's rule, Eq. 4-7) or
            ``"hard"`` (mean of the last ``window`` observations, appendix F).
        eta: the soft rule's gain; eta_t = clamp(eta * sigma_t, eta_min, 1).
        window: m for the soft rule (beliefs in sigma_t), h for the hard rule; the kalman
            rule does not use it.
        eta_min: floor of eta_t that keeps the soft rule from freezing; 0 is the paper.
        belief: ``"prior"`` (C_t-, before y_t is folded in: the paper; for the kalman rule
            the bank's one-step prediction) or ``"posterior"`` (C_t+: the authors' code).
        initial: C_1-; default the first batch's mean reward. The kalman rule's bank
            starts from the first batch's mean either way.
    """

    def __init__(
        self,
        rule: str = DEFAULT_RULE,
        *,
        eta: float = DEFAULT_ETA,
        window: int = DEFAULT_WINDOW,
        eta_min: float = DEFAULT_ETA_MIN,
        belief: str = "prior",
        initial: float | None = None,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
        if belief not in BELIEFS:
            raise ValueError(f"unknown belief {belief!r}; expected one of {BELIEFS}")
        if not is_number(eta) or not 0 <= eta < math.inf:
            raise ValueError(f"eta must be finite and non-negative, got {eta!r}")
        if not is_number(eta_min) or not 0 <= eta_min <= 1:
            raise ValueError(f"eta_min must lie in [0, 1], got {eta_min!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if initial is not None and (not is_number(initial) or not 0 <= initial <= 1):
            raise ValueError(f"initial must lie in [0, 1] (a belief about an accuracy), got {initial!r}")
        self.rule = rule
        self.eta = float(eta)
        self.window = window
        self.eta_min = float(eta_min)
        self.belief = belief
        self.initial = None if initial is None else float(initial)
        self.reset()

    @classmethod
    def authors_code(cls) -> "DifficultyAnchor":
        """The authors' public code: hard rule over 10 batches, posterior belief.
        Use it with ``lambda_scale=config.AUTHORS_LAMBDA_SCALE`` (1.5) in the loss, as they do."""
        return cls("hard", window=10, belief="posterior")

    def reset(self) -> None:
        self.step = 0
        self.prior: float | None = self.initial
        self.posterior: float | None = None
        self.observation: float | None = None
        self.eta_t: float | None = None
        self.sigma_t: float | None = None
        self._observations: deque[float] = deque(maxlen=self.window)
        self._posteriors: deque[float] = deque(maxlen=self.window)
        self._warmup_sum = 0.0
        # The kalman rule's bank (None before its first batch): model probabilities mu (M),
        # states x (M x 2: level, slope), covariances P (M x 2 x 2), and the two decayed
        # sums whose ratio is phi.
        self._mu: np.ndarray | None = None
        self._x: np.ndarray | None = None
        self._P: np.ndarray | None = None
        self._variance_sum = 0.0
        self._bernoulli_sum = 0.0

    @property
    def value(self) -> float | None:
        """The belief the weights use now (None before the first update)."""
        return self.prior if self.belief == "prior" else self.posterior

    def update(self, rewards: torch.Tensor) -> float:
        """Folds one rollout batch's rewards in and returns the belief for its weights.

        ``rewards``: a floating-point tensor (as the losses take them) or a sequence of
        numbers, in [0, 1]. Under torch.distributed the sums and the count of rewards are
        all-reduced, so every rank holds the same belief (never a mean of per-rank means).
        """
        rewards = checked_rewards(rewards)
        mean, variance, count = batch_reward_statistics(rewards)
        self.observe(mean, count=count, variance=variance)
        value = self.value
        if value is None:  # observe sets the prior (from y_1 at the latest) and the posterior
            raise RuntimeError("the anchor holds no belief after an update")
        return value

    def observe(self, y: float, *, count: int | None = None, variance: float | None = None) -> None:
        """One step of the belief given the batch accuracy y_t.

        The kalman rule also needs ``count`` (B_t, the rewards y_t is the mean of) and
        takes ``variance``, their unbiased sample variance (default: binary rewards).
        """
        if isinstance(y, bool) or not isinstance(y, numbers.Real) or not math.isfinite(y):
            raise ValueError(f"observation y_t must be a finite number, got {y!r}")
        if not 0 <= y <= 1:
            raise ValueError(f"observation y_t must lie in [0, 1] (an accuracy, a mean reward in [0, 1]), got {y!r}")
        if self.rule == "kalman":
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
                raise ValueError(f"the kalman rule needs the batch's reward count (a positive int), got {count!r}")
            if variance is not None and (isinstance(variance, bool) or not isinstance(variance, numbers.Real)
                                         or not math.isfinite(variance) or variance < 0):
                raise ValueError(f"reward variance must be finite and non-negative, got {variance!r}")
            count = int(count)
        y = float(y)
        self.step += 1
        self.observation = y
        self._observations.append(y)
        if self.rule == "kalman":
            self._imm_step(y, count, y * (1.0 - y) if variance is None else float(variance))
            self._posteriors.append(self.posterior)
            return
        if self.posterior is not None:
            self.prior = self.posterior  # C_{t-1}+ becomes C_t-
        elif self.prior is None:
            self.prior = y  # C_1- = y_1 when no initial value is given

        if self.rule == "hard":
            self.eta_t, self.sigma_t = None, None
            self.posterior = sum(self._observations) / len(self._observations)
        elif len(self._posteriors) < self.window:
            # Warm-up: sigma_t needs m posterior beliefs; use the running mean.
            self._warmup_sum += y
            self.eta_t, self.sigma_t = 1.0 / self.step, None
            self.posterior = self._warmup_sum / self.step
        else:
            mean = sum(self._posteriors) / len(self._posteriors)
            self.sigma_t = math.sqrt(sum((c - mean) ** 2 for c in self._posteriors) / len(self._posteriors))
            self.eta_t = min(max(self.eta * self.sigma_t, self.eta_min), 1.0)
            self.posterior = (1.0 - self.eta_t) * self.prior + self.eta_t * y
        self._posteriors.append(self.posterior)

    def _bank_state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The kalman rule's bank (mu, x, P), None before its first batch: the three are
        set together (:meth:`_imm_step`, :meth:`load_state_dict`) and cleared together
        (:meth:`reset`)."""
        if self._mu is None or self._x is None or self._P is None:
            return None
        return self._mu, self._x, self._P

    def _imm_step(self, y: float, count: int, variance: float) -> None:
        """One batch of the IMM bank (docs/math.md, "The kalman rule"), over all models at once."""
        # phi: the pooled ratio of the rewards' variance to a Bernoulli variance at their
        # mean (1 for binary rewards, less for partial credit), decayed so it is steady.
        self._variance_sum = PHI_DECAY * self._variance_sum + variance
        self._bernoulli_sum = PHI_DECAY * self._bernoulli_sum + y * (1.0 - y)
        phi = 1.0 if self._bernoulli_sum == 0.0 else min(max(self._variance_sum / self._bernoulli_sum, PHI_MIN), 1.0)

        def observation_noise(belief: float) -> float:
            # R_t, with the belief kept 0.5 / (B + 1) away from 0 and 1 so that R_t > 0.
            edge = 0.5 / (count + 1)
            clamped = min(max(belief, edge), 1.0 - edge)
            return phi * clamped * (1.0 - clamped) / count

        state = self._bank_state()
        if state is None:  # the first batch: every model at level y_1, slope 0
            self._mu = np.full(MODELS, 1.0 / MODELS)
            self._x = np.zeros((MODELS, 2))
            self._x[:, 0] = y
            self._P = np.zeros((MODELS, 2, 2))
            self._P[:, 0, 0] = observation_noise(y)
            self._P[_IS_TREND, 1, 1] = SLOPE_PRIOR_VARIANCE
            if self.prior is None:
                self.prior = y
            self.posterior, self.eta_t = y, None
            self.sigma_t = math.sqrt(self._P[0, 0, 0])
            return

        mu, x, P = state
        # 1. predicted model probabilities c_j and mixing weights w_ij = pi_ij mu_i / c_j.
        joint = _SWITCHING * mu[:, None]
        c = joint.sum(axis=0)
        w = joint / c[None, :]
        # 2. each model starts from the mixture of all models' states.
        x0 = w.T @ x
        spread = x[:, None, :] - x0[None, :, :]  # (i, j, 2)
        P0 = np.einsum("ij,iab->jab", w, P) + np.einsum("ij,ija,ijb->jab", w, spread, spread)
        # 3. predict.
        xp = np.einsum("jab,jb->ja", _TRANSITION, x0)
        Pp = _TRANSITION @ P0 @ _TRANSITION.transpose(0, 2, 1) + _PROCESS_NOISE
        # The prediction is the one step that can take a level out of [0, 1] (the mixing
        # above and the update below are convex combinations of levels in [0, 1] and y_t).
        xp = _level_in_bounds(xp, Pp)
        # 4. the prior belief: the bank's one-step prediction, before y_t.
        prior = _mixture_level(c, xp[:, 0])
        # 5. the observation noise at the prior belief.
        noise = observation_noise(prior)
        # 6. update each model with y_t.
        innovation = y - xp[:, 0]
        S = Pp[:, 0, 0] + noise
        gain = Pp[:, :, 0] / S[:, None]
        x_new = xp + gain * innovation[:, None]
        P_new = Pp - gain[:, :, None] * Pp[:, None, 0, :]
        # Symmetric to the bit, so that the three entries state_dict() keeps are the state.
        P_new[:, 1, 0] = P_new[:, 0, 1]
        # 7. model probabilities from each model's likelihood of the innovation (in logs,
        # so no likelihood underflows), floored so that no model is ruled out for good.
        log_likelihood = np.log(c) - 0.5 * innovation**2 / S - 0.5 * np.log(2.0 * math.pi * S)
        likelihood = np.exp(log_likelihood - log_likelihood.max())
        mu_new = np.maximum(likelihood / likelihood.sum(), MODEL_PROBABILITY_FLOOR)

        self._mu, self._x, self._P = mu_new, x_new, P_new
        levels = x_new[:, 0]
        posterior = _mixture_level(mu_new, levels)
        self.prior, self.posterior = prior, posterior
        # eta_t: the gain the whole bank applied to the innovation, for the logs.
        self.eta_t = (posterior - prior) / (y - prior) if y != prior else None
        # sigma_t: the standard deviation of the level under the mixture.
        self.sigma_t = math.sqrt(max(0.0, float(mu_new @ (P_new[:, 0, 0] + (levels - posterior) ** 2))))

    def figures(self) -> dict[str, float | None]:
        """The belief in use, y_t, C_t-, C_t+, eta_t and sigma_t of the last update, for
        logging. For the kalman rule eta_t is the bank's effective gain
        (C_t+ - C_t-) / (y_t - C_t-) (None where y_t = C_t-) and sigma_t the standard
        deviation of the level under the bank's mixture."""
        return {
            "anchor/step": self.step,
            "anchor/belief": self.value,
            "anchor/y": self.observation,
            "anchor/prior": self.prior,
            "anchor/posterior": self.posterior,
            "anchor/eta": self.eta_t,
            "anchor/sigma": self.sigma_t,
        }

    def _config(self) -> dict:
        return {
            "rule": self.rule,
            "eta": self.eta,
            "window": self.window,
            "eta_min": self.eta_min,
            "belief": self.belief,
            "initial": self.initial,
        }

    def state_dict(self) -> dict:
        """The whole state as plain Python numbers and lists (JSON-ready), versioned."""
        bank = None
        state = self._bank_state()
        if state is not None:
            mu, x, P = state
            bank = {
                "mu": mu.tolist(),
                "x": x.tolist(),
                "P": np.stack([P[:, 0, 0], P[:, 0, 1], P[:, 1, 1]], axis=1).tolist(),
                "variance_sum": self._variance_sum,
                "bernoulli_sum": self._bernoulli_sum,
            }
        return {
            "version": STATE_VERSION,
            "config": self._config(),
            "step": self.step,
            "prior": self.prior,
            "posterior": self.posterior,
            "observation": self.observation,
            "eta_t": self.eta_t,
            "sigma_t": self.sigma_t,
            "observations": list(self._observations),
            "posteriors": list(self._posteriors),
            "warmup_sum": self._warmup_sum,
            "bank": bank,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict()``. The whole state is checked (keys, types, shapes,
        finiteness, ranges) before any of it is assigned, so a bad state changes nothing.

        A soft or hard rule's state from before the versioned layout loads; the kalman
        rule's state from before the IMM bank (one filter) is refused: start afresh."""
        state = checked_state(state, self._config(), MODELS)
        self.step = state["step"]
        self.prior = state["prior"]
        self.posterior = state["posterior"]
        self.observation = state["observation"]
        self.eta_t = state["eta_t"]
        self.sigma_t = state["sigma_t"]
        self._observations = deque(state["observations"], maxlen=self.window)
        self._posteriors = deque(state["posteriors"], maxlen=self.window)
        self._warmup_sum = state["warmup_sum"]
        bank = state["bank"]
        if bank is None:
            self._mu = self._x = self._P = None
            self._variance_sum = self._bernoulli_sum = 0.0
        else:
            self._mu = np.array(bank["mu"], dtype=np.float64)
            self._x = np.array(bank["x"], dtype=np.float64)
            unique = np.array(bank["P"], dtype=np.float64)
            self._P = np.stack([unique[:, [0, 1]], unique[:, [1, 2]]], axis=1)
            self._variance_sum = bank["variance_sum"]
            self._bernoulli_sum = bank["bernoulli_sum"]

    def __repr__(self) -> str:
        return (
            f"DifficultyAnchor(rule={self.rule!r}, eta={self.eta}, window={self.window}, "
            f"eta_min={self.eta_min}, belief={self.belief!r}, step={self.step}, value={self.value})"
        )


def checked_rewards(rewards, why: str = "the anchor is a belief about an accuracy (the paper's y_t)") -> torch.Tensor:
    """Rewards as a float64 tensor, refused unless finite and in [0, 1] (``why``: what reads
    them as accuracies). A tensor must be floating point, as the losses require (an int or
    bool tensor is refused with their message); a sequence or array of numbers is
    converted."""
    if not isinstance(rewards, torch.Tensor):
        try:
            rewards = torch.as_tensor(rewards, dtype=torch.float64)
        except (TypeError, ValueError) as error:
            raise TypeError(f"rewards must be a tensor or a sequence of numbers, got {type(rewards).__name__}") \
                from error
    require_float("rewards", rewards)
    rewards = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite: they contain NaN or inf")
    if bool(((rewards < 0) | (rewards > 1)).any()):
        raise ValueError(f"rewards must lie in [0, 1]: {why}; scale the rewards into [0, 1] first")
    return rewards


def batch_reward_statistics(rewards: torch.Tensor, *, all_reduce: bool = True) -> tuple[float, float, int]:
    """y_t, the rewards' unbiased sample variance and their count over the whole rollout
    batch, all-reduced across data-parallel ranks (``all_reduce=False``: rewards already
    gathered from every rank, as TRL does)."""
    rewards = rewards.detach().reshape(-1).to(torch.float64)
    totals = torch.stack([rewards.sum(), rewards.square().sum(), rewards.new_tensor(float(rewards.numel()))])
    if all_reduce and distributed.is_distributed():
        if dist.get_backend() == "nccl":
            totals = totals.to(torch.device("cuda", torch.cuda.current_device()))
        totals = distributed.all_reduce(totals)
    total, squares, count = totals.tolist()
    if count == 0:
        raise ValueError("cannot update the anchor from an empty batch of rewards")
    mean = total / count
    variance = max(0.0, squares - count * mean * mean) / (count - 1) if count > 1 else 0.0
    return mean, variance, int(count)
