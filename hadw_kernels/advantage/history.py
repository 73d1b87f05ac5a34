"""Per-prompt history: a discounted Beta posterior of each prompt's success rate, for the
``prompt_history`` estimator (docs/math.md, section 2a).

Like :class:`~hadw_kernels.advantage.anchor.DifficultyAnchor` it lives across rollout batches:
once per batch, :meth:`PromptHistory.update` returns each response's pseudo-counts
(alpha, beta) read before the batch is folded in, which ``hadw_advantages(...,
estimator="prompt_history", prior=...)`` turns into leave-one-out baselines. Prompts are
named by integer keys the caller gives (:func:`prompt_key` hashes a prompt's tokens).
"""

from __future__ import annotations

import hashlib
import math
import numbers
import warnings
from collections.abc import Sequence

import torch

from ..distributed import all_gather_objects
from ..tables.bounds import check_finite_positive
from .anchor import checked_rewards

# Version 2 tags a text's key apart from a token list's (prompt_key) and records whether
# any key recurred; a version-1 state still loads (its token keys are unchanged).
STATE_VERSION = 2
LOADED_VERSIONS = (1, 2)
# Rollout batches after which a history none of whose keys has recurred warns, once: its
# baselines read the prior alone (docs/math.md, section 2a).
RECURRENCE_WINDOW = 20
# The discount per rollout batch, chosen by docs/estimators.md's measurement of 0.5-1.0,
# and the prior's strength: two pseudo-responses at the discounted mean reward, a weak
# prior that was not measured against another strength (docs/math.md, section 2a).
DEFAULT_DISCOUNT = 0.9
DEFAULT_PRIOR_STRENGTH = 2.0


def prompt_key(tokens: Sequence[int] | torch.Tensor | str) -> int:
    """A stable non-negative 63-bit key for a prompt's token ids (or its text): the same on
    every rank and in every process, unlike Python's ``hash``. A text and a list of token
    ids never share a key (``"1,2,3"`` is not ``[1, 2, 3]``); token ids must be integers."""
    if isinstance(tokens, str):
        data = b"text:" + tokens.encode()
    else:
        if isinstance(tokens, torch.Tensor) or (hasattr(tokens, "tolist") and not isinstance(tokens, Sequence)):
            tokens = tokens.reshape(-1).tolist()  # a tensor's or array's ids, as Python numbers
        if isinstance(tokens, (bytes, bytearray)) or not isinstance(tokens, Sequence) or not all(
                isinstance(token, numbers.Integral) and not isinstance(token, bool) for token in tokens):
            raise TypeError(f"prompt_key takes integer token ids or a str, got {tokens!r:.80}")
        data = ",".join(str(int(token)) for token in tokens).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class PromptHistory:
    """alpha_x, beta_x per prompt key: successes and failures, each discounted by
    ``discount`` per rollout batch since they were seen. A prompt never seen reads the
    prior: strength ``prior_strength`` at the mean of every reward seen so far (itself
    discounted the same way; 1/2 before the first batch)."""

    def __init__(self, discount: float = DEFAULT_DISCOUNT, prior_strength: float = DEFAULT_PRIOR_STRENGTH) -> None:
        check_finite_positive("discount", discount)
        if discount > 1:
            raise ValueError(f"discount must be in (0, 1], got {discount!r}")
        check_finite_positive("prior_strength", prior_strength)
        self.discount, self.prior_strength = float(discount), float(prior_strength)
        self.reset()

    def reset(self) -> None:
        self.step = 0
        # key -> [alpha, beta, step of the last update]
        self._prompts: dict[int, list[float]] = {}
        self._seen = [0.0, 0.0]  # every reward's discounted successes and failures
        self._recurred = False  # whether any batch held a key an earlier one had

    def __len__(self) -> int:
        return len(self._prompts)

    def _decay(self, since: float) -> float:
        return self.discount ** (self.step - since)

    def prior_mean(self) -> float:
        successes, failures = self._seen
        return successes / (successes + failures) if successes + failures > 0 else 0.5

    def read(self, keys: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[K, 2] float64 (alpha, beta) of each key, as of now (no update)."""
        keys = _keys(keys)
        mean = self.prior_mean()
        prior = (self.prior_strength * mean, self.prior_strength * (1 - mean))
        rows = []
        for key in keys:
            seen = self._prompts.get(key)
            if seen is None:
                rows.append(prior)
            else:
                decay = self._decay(seen[2])
                rows.append((prior[0] + decay * seen[0], prior[1] + decay * seen[1]))
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 2)

    def update(self, rewards, prompt_keys: Sequence[int] | torch.Tensor, *, all_gather: bool = True) -> torch.Tensor:
        """Folds one rollout batch in and returns each response's (alpha, beta) [B, 2]
        read before it, on the rewards' device (float64).

        ``rewards`` [B] in [0, 1]; ``prompt_keys`` [B] each response's prompt key
        (integers; a group's responses share theirs). Under torch.distributed each rank's
        keys and rewards are gathered, so every rank folds in the whole batch and holds the
        same history; the pseudo-counts returned are this rank's responses'.
        ``all_gather=False``: the rewards and keys are every rank's already (TRL gathers
        them)."""
        device = rewards.device if isinstance(rewards, torch.Tensor) else torch.device("cpu")
        values = checked_rewards(rewards, "the history counts them as its Beta posterior's successes").reshape(-1)
        keys = _keys(prompt_keys)
        if len(keys) != values.numel():
            raise ValueError(f"prompt_keys has {len(keys)} entries, rewards {values.numel()}")
        if values.numel() == 0:
            raise ValueError("cannot update the history from an empty batch of rewards")
        prior = self.read(keys)
        totals: dict[int, list[float]] = {}
        gathered = all_gather_objects if all_gather else list
        for key, value in zip(gathered(keys), gathered(values.tolist())):
            entry = totals.setdefault(key, [0.0, 0.0])
            entry[0] += value
            entry[1] += 1.0 - value
        self._recurred = self._recurred or any(key in self._prompts for key in totals)
        self.step += 1
        if self.step == RECURRENCE_WINDOW and not self._recurred:
            warnings.warn(
                f"PromptHistory: no prompt key has recurred in {RECURRENCE_WINDOW} rollout batches, so every baseline "
                "reads the prior alone: key prompts by their tokens (prompt_key(token_ids)), not by ids made anew "
                "each step such as verl's uids; prompts that come back this seldom gain nothing from the history",
                UserWarning, stacklevel=2)
        decay = self.discount
        self._seen = [decay * self._seen[0], decay * self._seen[1]]
        for key, (successes, failures) in totals.items():
            self._seen[0] += successes
            self._seen[1] += failures
            seen = self._prompts.get(key)
            if seen is None:
                self._prompts[key] = [successes, failures, self.step]
            else:
                carried = self._decay(seen[2])
                self._prompts[key] = [carried * seen[0] + successes, carried * seen[1] + failures, self.step]
        return prior.to(device)

    def state_dict(self) -> dict:
        """The whole state as plain numbers and lists (JSON-ready), versioned."""
        return {
            "version": STATE_VERSION,
            "config": {"discount": self.discount, "prior_strength": self.prior_strength},
            "step": self.step,
            "seen": list(self._seen),
            "recurred": self._recurred,
            "prompts": [[key, *values] for key, values in self._prompts.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict()``, checked whole before anything is assigned; a state
        saved with another discount or prior strength is refused (its counts mean another
        thing). A version-1 state loads with a warning: its keys of texts were hashed
        untagged, so those prompts start afresh (token keys are unchanged)."""
        version = state.get("version") if isinstance(state, dict) else None
        if version not in LOADED_VERSIONS:
            raise ValueError(f"not a PromptHistory state of version {' or '.join(map(str, LOADED_VERSIONS))}")
        recurred = state.get("recurred", True) if version == 1 else state.get("recurred")
        if not isinstance(recurred, bool):
            raise ValueError("the history state is malformed (recurred)")
        config = {"discount": self.discount, "prior_strength": self.prior_strength}
        if state.get("config") != config:
            raise ValueError(f"the state was saved with {state.get('config')}, this history has {config}")
        step, seen, prompts = state.get("step"), state.get("seen"), state.get("prompts")
        malformed = "the history state is malformed (step, seen or prompts)"
        if not (isinstance(seen, list) and isinstance(prompts, list)
                and all(isinstance(row, list) and len(row) == 4 for row in prompts)):
            raise ValueError(malformed)
        numbers = [*seen, *(v for row in prompts for v in row[1:])]
        if not isinstance(step, int) or step < 0 or len(seen) != 2 or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in numbers) or not all(
                isinstance(row[0], int) and row[3] <= step for row in prompts) or \
                len({row[0] for row in prompts}) != len(prompts):
            raise ValueError(malformed)
        if version == 1:
            warnings.warn("a version-1 PromptHistory state: prompts keyed by prompt_key(text) hash differently now "
                          "and start afresh (keys of token ids are unchanged)", UserWarning, stacklevel=2)
        self.step = step
        self._seen = [float(seen[0]), float(seen[1])]
        self._prompts = {row[0]: [float(row[1]), float(row[2]), row[3]] for row in prompts}
        self._recurred = recurred

    def __repr__(self) -> str:
        return (f"PromptHistory(discount={self.discount}, prior_strength={self.prior_strength}, "
                f"step={self.step}, prompts={len(self)})")


def _keys(keys) -> list[int]:
    if isinstance(keys, torch.Tensor):
        if keys.dim() != 1 or keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool:
            raise TypeError(f"prompt_keys must be a 1-D integer tensor, got {keys.dtype} of shape {tuple(keys.shape)}")
        return keys.tolist()
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"prompt_keys must be a sequence of integers, got {type(keys).__name__}")
    if not all(isinstance(key, int) and not isinstance(key, bool) for key in keys):
        raise TypeError("prompt_keys must hold integers (e.g. hadw_kernels.prompt_key(tokens))")
    return list(keys)
