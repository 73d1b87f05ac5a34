"""The difficulty anchor's saved state (``DifficultyAnchor.state_dict``), checked whole
before an anchor loads it: its version, its keys, the options it was saved with, every
number in its range (beliefs and observations are accuracies, in [0, 1]) and, for the
Kalman rule, its bank of filters (probabilities that sum to 1, levels in [0, 1],
positive semi-definite covariances). A state that fails is refused by name, and the
anchor is left as it was.
"""

from __future__ import annotations

import math

import numpy as np

# The version of state_dict()'s layout. Version 1 (no "version" key) held the single
# Kalman filter with an innovation-estimated process noise; version 2 holds the IMM bank.
STATE_VERSION = 2


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checked_state(state, config: dict, models: int) -> dict:
    """The state to load, checked whole, for an anchor of ``config`` (``DifficultyAnchor``'s
    options) whose Kalman bank holds ``models`` models; version 1 soft/hard states are
    brought to version 2."""
    if not isinstance(state, dict):
        raise TypeError(f"anchor state must be a dict, got {type(state).__name__}")
    saved_config = state.get("config")
    if not isinstance(saved_config, dict):
        raise ValueError(f"anchor state 'config' must be a dict, got {saved_config!r}")
    if "version" not in state:
        if saved_config.get("rule") == "kalman":
            raise ValueError(
                "this anchor state is the pre-IMM kalman state (one Kalman filter with an innovation-estimated "
                "process noise, saved before the kalman rule became an IMM bank of filters); it cannot be resumed "
                "by the IMM kalman rule: start the anchor afresh (drop the saved anchor state)"
            )
        # Version 1 of the soft and hard rules: the same state plus the old filter's unused fields.
        state = dict(state)
        saved_config = {key: value for key, value in saved_config.items() if key != "process_noise_min"}
        state.update(version=STATE_VERSION, config=saved_config, bank=None)
        for key in ("variance", "innovations"):
            state.pop(key, None)
    if state["version"] != STATE_VERSION:
        raise ValueError(f"anchor state has version {state['version']!r}; this library reads version {STATE_VERSION}")
    expected = {"version", "config", "step", "prior", "posterior", "observation", "eta_t", "sigma_t",
                "observations", "posteriors", "warmup_sum", "bank"}
    missing, unknown = expected - set(state), set(state) - expected
    if missing or unknown:
        raise ValueError(f"anchor state has missing keys {sorted(missing)} and unknown keys {sorted(unknown)}")
    if saved_config != config:
        raise ValueError(f"anchor state was saved with {saved_config}, this anchor has {config}")

    def number(key, value, *, optional=False, low=-math.inf, high=math.inf):
        if value is None and optional:
            return
        if not is_number(value) or not math.isfinite(value) or not low <= value <= high:
            what = "a finite number" + (f" in [{low:g}, {high:g}]" if (low, high) != (-math.inf, math.inf) else "")
            raise ValueError(f"anchor state {key!r} must be {what}{' or None' if optional else ''}, got {value!r}")

    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"anchor state 'step' must be a non-negative int, got {step!r}")
    # Beliefs and observations are accuracies: no update puts one outside [0, 1].
    for key in ("prior", "posterior", "observation"):
        number(key, state[key], optional=True, low=0.0, high=1.0)
    number("eta_t", state["eta_t"], optional=True)
    number("sigma_t", state["sigma_t"], optional=True, low=0.0)
    number("warmup_sum", state["warmup_sum"])
    window = config["window"]
    for key in ("observations", "posteriors"):
        values = state[key]
        if not isinstance(values, list) or len(values) > window:
            raise ValueError(f"anchor state {key!r} must be a list of at most {window} numbers, got {values!r}")
        for value in values:
            number(key, value, low=0.0, high=1.0)
        if len(values) > step:
            raise ValueError(f"anchor state {key!r} holds {len(values)} values after {step} steps")
    if step > 0 and (state["posterior"] is None or state["observation"] is None):
        raise ValueError(f"anchor state after {step} steps must hold a posterior and an observation")

    bank = state["bank"]
    if config["rule"] != "kalman" or step == 0:
        if bank is not None:
            raise ValueError(f"anchor state 'bank' must be None for the {config['rule']} rule at step {step}")
        return state
    if not isinstance(bank, dict) or set(bank) != {"mu", "x", "P", "variance_sum", "bernoulli_sum"}:
        raise ValueError(
            "anchor state 'bank' must be a dict of mu, x, P, variance_sum and bernoulli_sum, got "
            f"{sorted(bank) if isinstance(bank, dict) else type(bank).__name__}"
        )
    arrays = {}
    for key, shape in (("mu", (models,)), ("x", (models, 2)), ("P", (models, 3))):
        value = bank[key]
        try:
            array = np.array(value, dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise ValueError(f"anchor state bank {key!r} must be numbers of shape {shape}: {error}") from error
        if array.shape != shape or not _only_numbers(value):
            raise ValueError(f"anchor state bank {key!r} must be numbers of shape {shape}, got shape {array.shape}")
        if not np.isfinite(array).all():
            raise ValueError(f"anchor state bank {key!r} must be finite")
        arrays[key] = array
    mu, P = arrays["mu"], arrays["P"]
    if (arrays["x"][:, 0] < 0).any() or (arrays["x"][:, 0] > 1).any():
        raise ValueError("anchor state bank 'x' must hold levels (its first column) in [0, 1]: each is an accuracy")
    if (mu < 0).any() or (mu > 1).any() or abs(mu.sum() - 1.0) > 1e-6:
        raise ValueError("anchor state bank 'mu' must be probabilities in [0, 1] that sum to 1")
    # Each P_j symmetric positive semi-definite: P00, P11 >= 0 and P01^2 <= P00 P11 (to rounding).
    if (P[:, 0] < 0).any() or (P[:, 2] < 0).any() or (P[:, 1] ** 2 > P[:, 0] * P[:, 2] * (1 + 1e-6) + 1e-300).any():
        raise ValueError("anchor state bank 'P' must hold positive semi-definite covariances (P00, P01, P11)")
    number("bank variance_sum", bank["variance_sum"], low=0.0)
    number("bank bernoulli_sum", bank["bernoulli_sum"], low=0.0)
    return state


def _only_numbers(value) -> bool:
    """A nested list of plain numbers (no strings or bools numpy would convert)."""
    if isinstance(value, (list, tuple)):
        return all(_only_numbers(item) for item in value)
    return is_number(value)
