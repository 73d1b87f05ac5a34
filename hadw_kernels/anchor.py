"""The evolving difficulty anchor C_t (paper section 3.1 and appendix F, SPEC section 3).

The anchor is a belief about the model's accuracy that lives across rollout batches.
Update it once per rollout batch (not per mini-batch or PPO epoch) with that batch's
rewards; :meth:`DifficultyAnchor.update` returns the belief the HA-DW weights use.

The soft rule has a trap the paper does not mention: eta_t = eta * sigma_t, and sigma_t
is the spread of the recent beliefs, so once the beliefs stop moving eta_t -> 0 and they
never move again. A large ``eta`` and the floor ``eta_min`` keep the anchor tracking;
the defaults were chosen by simulating a ramp and a step of accuracy (see
``tests/test_anchor.py`` and the README). They were chosen at 2048 rewards a batch: at
64, eta_t sits at its cap of 1 and the belief is the previous batch's noisy mean.

The Kalman rule is a filter in fact: y_t is a mean of B_t rewards, so its noise variance
is known, R_t = s_t^2 / B_t (s_t^2 the rewards' sample variance, y(1-y) for binary ones),
and the gain K_t = P_t- / (P_t- + R_t) weighs it against the belief's own uncertainty:
small batches are smoothed, large ones trusted. The process noise Q_t (how far the true
accuracy moves in a batch) is estimated from the recent innovations nu = y_t - C_t-,
whose expected square is P_{t-1}+ + Q_t + R_t (Mehra's innovation-based estimate), and
floored at ``process_noise_min``; a jump in accuracy shows as large innovations and
raises the gain within a batch or two. ``python -m hadw_kernels.theory.anchor_tracking``
measures every rule's tracking error (the README quotes it).
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist

RULES = ("soft", "hard", "kalman")
BELIEFS = ("prior", "posterior")

# Chosen by simulation (2048 binary rewards a batch, ramp 0.3->0.7 over 300 steps and a
# step 0.3->0.7): both tracked within 0.03 on average after warm-up.
DEFAULT_ETA = 50.0
DEFAULT_WINDOW = 10
DEFAULT_ETA_MIN = 0.05

# The Kalman rule's floor on the process noise variance: the true accuracy is assumed
# to move by at least ~0.003 a batch, so the gain never reaches 0 (the soft rule's freeze).
DEFAULT_PROCESS_NOISE_MIN = 1e-5


class DifficultyAnchor:
    """Tracks C_t across rollout batches.

    Args:
        rule: ``"soft"`` (Kalman-style, paper Eq. 4-7), ``"hard"`` (mean of the last
            ``window`` observations, appendix F) or ``"kalman"`` (a Kalman filter with
            the observation noise of a mean of B_t rewards, above).
        eta: the soft rule's gain; eta_t = clamp(eta * sigma_t, eta_min, 1).
        window: m for the soft rule (beliefs in sigma_t), h for the hard rule, the
            innovations the Kalman rule estimates the process noise from.
        eta_min: floor of eta_t that keeps the soft rule from freezing; 0 is the paper.
        process_noise_min: the Kalman rule's floor on the process noise variance Q_t.
        belief: ``"prior"`` (C_t-, before y_t is folded in: the paper) or
            ``"posterior"`` (C_t+: the authors' code).
        initial: C_1-; default the first batch's mean reward.
    """

    def __init__(
        self,
        rule: str = "soft",
        *,
        eta: float = DEFAULT_ETA,
        window: int = DEFAULT_WINDOW,
        eta_min: float = DEFAULT_ETA_MIN,
        process_noise_min: float = DEFAULT_PROCESS_NOISE_MIN,
        belief: str = "prior",
        initial: float | None = None,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
        if belief not in BELIEFS:
            raise ValueError(f"unknown belief {belief!r}; expected one of {BELIEFS}")
        if not _is_number(eta) or not 0 <= eta < math.inf:
            raise ValueError(f"eta must be finite and non-negative, got {eta!r}")
        if not _is_number(eta_min) or not 0 <= eta_min <= 1:
            raise ValueError(f"eta_min must lie in [0, 1], got {eta_min!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if not _is_number(process_noise_min) or not 0 < process_noise_min < math.inf:
            raise ValueError(f"process_noise_min must be positive and finite, got {process_noise_min!r}")
        if initial is not None and (not _is_number(initial) or not 0 <= initial <= 1):
            raise ValueError(f"initial must lie in [0, 1] (a belief about an accuracy), got {initial!r}")
        self.rule = rule
        self.eta = float(eta)
        self.window = window
        self.eta_min = float(eta_min)
        self.process_noise_min = float(process_noise_min)
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
        self.variance: float | None = None  # the Kalman rule's P_t+
        self._innovations: deque[float] = deque(maxlen=self.window)

    @property
    def value(self) -> float | None:
        """The belief the weights use now (None before the first update)."""
        return self.prior if self.belief == "prior" else self.posterior

    def update(self, rewards: torch.Tensor) -> float:
        """Folds one rollout batch's rewards in and returns the belief for its weights.

        Under torch.distributed the sums and the count of rewards are all-reduced, so
        every rank holds the same belief (never a mean of per-rank means).
        """
        if not isinstance(rewards, torch.Tensor):
            try:
                rewards = torch.as_tensor(rewards, dtype=torch.float64)
            except (TypeError, ValueError) as error:
                raise TypeError(f"rewards must be a tensor or a sequence of numbers, got {type(rewards).__name__}") \
                    from error
        if rewards.is_complex():
            raise TypeError(f"rewards must be real numbers, got {rewards.dtype}")
        rewards = rewards.detach().to(torch.float64)
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError("rewards must be finite: they contain NaN or inf")
        if bool(((rewards < 0) | (rewards > 1)).any()):
            raise ValueError(
                "rewards must lie in [0, 1]: the anchor is a belief about an accuracy (the paper's y_t); "
                "scale the rewards into [0, 1] first"
            )
        mean, variance, count = batch_reward_statistics(rewards)
        self.observe(mean, count=count, variance=variance)
        return self.value

    def observe(self, y: float, *, count: int | None = None, variance: float | None = None) -> None:
        """One step of the belief given the batch accuracy y_t.

        The Kalman rule also needs ``count`` (B_t, the rewards y_t is the mean of) and
        takes ``variance``, their sample variance (default y(1-y): binary rewards).
        """
        if not math.isfinite(y):
            raise ValueError(f"observation y_t must be finite, got {y}")
        if self.rule == "kalman":
            if count is None or count < 1:
                raise ValueError(f"the kalman rule needs the batch's reward count, got {count}")
            if variance is not None and not (math.isfinite(variance) and variance >= 0):
                raise ValueError(f"reward variance must be finite and non-negative, got {variance}")
        self.step += 1
        self.observation = y
        self._observations.append(y)
        if self.posterior is not None:
            self.prior = self.posterior  # C_{t-1}+ becomes C_t-
        elif self.prior is None:
            self.prior = y  # C_1- = y_1 when no initial value is given

        if self.rule == "hard":
            self.eta_t, self.sigma_t = None, None
            self.posterior = sum(self._observations) / len(self._observations)
        elif self.rule == "kalman":
            self._kalman_step(y, count, y * (1.0 - y) if variance is None else variance)
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

    def _kalman_step(self, y: float, count: int, variance: float) -> None:
        if variance == 0.0:
            # Every reward equal (all wrong, say) is not a noiseless observation: use the
            # Bernoulli variance at the Jeffreys estimate (k + 1/2) / (B + 1) instead.
            smoothed = (y * count + 0.5) / (count + 1)
            variance = smoothed * (1.0 - smoothed)
        noise = variance / count  # R_t: the variance of a mean of B_t rewards
        if self.variance is None:  # the first batch: C_1+ = y_1, as uncertain as y_1
            self.eta_t, self.variance, self.posterior = 1.0, noise, y
        else:
            innovation = y - self.prior
            # E[nu^2] = P_{t-1}+ + Q_t + R_t: what is left over estimates Q_t.
            self._innovations.append(innovation**2 - self.variance - noise)
            process_noise = max(self.process_noise_min, sum(self._innovations) / len(self._innovations))
            predicted = self.variance + process_noise
            self.eta_t = predicted / (predicted + noise)
            self.posterior = self.prior + self.eta_t * innovation
            self.variance = (1.0 - self.eta_t) * predicted
        self.sigma_t = math.sqrt(self.variance)

    def figures(self) -> dict[str, float | None]:
        """The belief in use, y_t, C_t-, C_t+, eta_t and sigma_t of the last update, for
        logging. For the Kalman rule eta_t is the gain K_t and sigma_t the belief's
        standard deviation sqrt(P_t+)."""
        return {
            "anchor/step": self.step,
            "anchor/belief": self.value,
            "anchor/y": self.observation,
            "anchor/prior": self.prior,
            "anchor/posterior": self.posterior,
            "anchor/eta": self.eta_t,
            "anchor/sigma": self.sigma_t,
        }

    def state_dict(self) -> dict:
        return {
            "config": {
                "rule": self.rule,
                "eta": self.eta,
                "window": self.window,
                "eta_min": self.eta_min,
                "process_noise_min": self.process_noise_min,
                "belief": self.belief,
                "initial": self.initial,
            },
            "step": self.step,
            "prior": self.prior,
            "posterior": self.posterior,
            "observation": self.observation,
            "eta_t": self.eta_t,
            "sigma_t": self.sigma_t,
            "observations": list(self._observations),
            "posteriors": list(self._posteriors),
            "warmup_sum": self._warmup_sum,
            "variance": self.variance,
            "innovations": list(self._innovations),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict()``; checked whole first, so a bad state changes nothing."""
        expected = self.state_dict()
        if not isinstance(state, dict):
            raise TypeError(f"anchor state must be a dict, got {type(state).__name__}")
        missing, unknown = set(expected) - set(state), set(state) - set(expected)
        if missing or unknown:
            raise ValueError(f"anchor state has missing keys {sorted(missing)} and unknown keys {sorted(unknown)}")
        if state["config"] != expected["config"]:
            raise ValueError(
                f"anchor state was saved with {state['config']}, this anchor has {expected['config']}"
            )
        for key in ("prior", "posterior", "observation"):
            value = state[key]
            if value is not None and (not _is_number(value) or not math.isfinite(value)):
                raise ValueError(f"anchor state {key!r} must be a finite number or None, got {value!r}")
        if not isinstance(state["step"], int) or state["step"] < 0:
            raise ValueError(f"anchor state 'step' must be a non-negative int, got {state['step']!r}")
        self.step = state["step"]
        self.prior = state["prior"]
        self.posterior = state["posterior"]
        self.observation = state["observation"]
        self.eta_t = state["eta_t"]
        self.sigma_t = state["sigma_t"]
        self._observations = deque(state["observations"], maxlen=self.window)
        self._posteriors = deque(state["posteriors"], maxlen=self.window)
        self._warmup_sum = state["warmup_sum"]
        self.variance = state["variance"]
        self._innovations = deque(state["innovations"], maxlen=self.window)

    def __repr__(self) -> str:
        return (
            f"DifficultyAnchor(rule={self.rule!r}, eta={self.eta}, window={self.window}, "
            f"eta_min={self.eta_min}, belief={self.belief!r}, step={self.step}, value={self.value})"
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def batch_reward_statistics(rewards: torch.Tensor) -> tuple[float, float, int]:
    """y_t, the rewards' sample variance and their count over the whole rollout batch,
    all-reduced across data-parallel ranks."""
    rewards = rewards.detach().reshape(-1).to(torch.float64)
    totals = torch.stack([rewards.sum(), rewards.square().sum(), rewards.new_tensor(float(rewards.numel()))])
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            totals = totals.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(totals)
    total, squares, count = totals.tolist()
    if count == 0:
        raise ValueError("cannot update the anchor from an empty batch of rewards")
    mean = total / count
    variance = max(0.0, squares - count * mean * mean) / (count - 1) if count > 1 else 0.0
    return mean, variance, int(count)
