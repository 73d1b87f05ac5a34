"""The advantage estimators (docs/math.md, section 2a): hadw_advantages and PromptHistory
against the float64 loops of hadw_kernels/reference/estimators.py, on exact small cases
and random batches, and their refusals."""

import warnings

import numpy as np
import pytest
import torch
from gloo_ranks import on_ranks

from hadw_kernels import (
    ESTIMATOR_NAMES,
    PromptHistory,
    available_backends,
    batch_totals,
    fused_hadw_grpo_loss,
    fused_linear_hadw_grpo_loss,
    hadw_advantages,
    prompt_key,
)
from hadw_kernels.reference import estimators as reference
from hadw_kernels.tables.estimators import ESTIMATORS

BATCH_ESTIMATORS = [name for name in ESTIMATOR_NAMES if ESTIMATORS[name].scope != "history"]


def _advantages(rewards, groups, estimator, **options):
    return hadw_advantages(torch.tensor(rewards, dtype=torch.float64), group_index=torch.tensor(groups),
                           estimator=estimator, **options)


# --- exact small cases --------------------------------------------------------------------


def test_g2_rloo_is_twice_the_centred_advantage_and_grpo_normalised_is_plus_minus_root_half():
    rewards = [1.0, 0.0, 0.0, 1.0]
    assert _advantages(rewards, [0, 0, 1, 1], "rloo").tolist() == [1.0, -1.0, -1.0, 1.0]
    assert _advantages(rewards, [0, 0, 1, 1], "grpo", normalize_std=False).tolist() == [0.5, -0.5, -0.5, 0.5]
    normalised = _advantages(rewards, [0, 0, 1, 1], "grpo")
    assert normalised.tolist() == pytest.approx([2 ** -0.5, -(2 ** -0.5)] * 1 + [-(2 ** -0.5), 2 ** -0.5], abs=1e-5)


def test_james_stein_by_hand():
    # Groups: {1, 0} (mean 1/2, var 1/2) and {1, 1} (mean 1, var 0), and {0, 0}.
    rewards, groups = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1, 2, 2]
    result = _advantages(rewards, groups, "james_stein").tolist()
    # Group 1 (all 1): the others are groups 0 and 2: v = mean(1/2 / 1, 0) = 1/4, their
    # means 1/2 and 0 around 1/4: s = 1/16, lambda = (1/4) / (5/16) = 4/5, m_other = 1/4;
    # b = 1/5 * 1 + 4/5 * 1/4 = 2/5, so A = 3/5 for both responses.
    assert result[2] == pytest.approx(0.6) and result[3] == pytest.approx(0.6)
    # Group 0: others are {1, 1} and {0, 0}: v = 0, lambda = 0, so RLOO: +1, -1.
    assert result[:2] == pytest.approx([1.0, -1.0])
    # Group 2 (all 0): others {1, 0} and {1, 1}: v = 1/4, means 1/2 and 1 around 3/4: s = 1/16,
    # lambda = 4/5, m_other = 3/4: b = 4/5 * 3/4 = 3/5, A = -3/5.
    assert result[4:] == pytest.approx([-0.6, -0.6])


@pytest.mark.parametrize("estimator", BATCH_ESTIMATORS)
def test_one_prompt_batch_uses_its_group_alone(estimator):
    # No other prompt: James-Stein has nothing to shrink toward and is RLOO.
    result = _advantages([1.0, 0.0, 0.0], [4, 4, 4], estimator, normalize_std=False)
    expected = reference.advantages([1.0, 0.0, 0.0], [4, 4, 4], estimator)
    assert result.tolist() == pytest.approx(expected)
    if estimator != "grpo":
        assert result.tolist() == pytest.approx([1.0, -0.5, -0.5])


def test_all_equal_groups_get_zero_in_group_and_signal_from_outside():
    rewards, groups = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1, 2, 2, 3, 3]
    for estimator in ("grpo", "rloo"):
        result = _advantages(rewards, groups, estimator, normalize_std=False)
        assert result[:2].tolist() == [0.0, 0.0] and result[6:].tolist() == [0.0, 0.0]
    shrunk = _advantages(rewards, groups, "james_stein")
    assert bool((shrunk[:2] > 0).all()) and bool((shrunk[6:] < 0).all())


def test_prompt_never_seen_reads_the_prior_and_a_seen_one_its_counts():
    history = PromptHistory(discount=0.5, prior_strength=2.0)
    first = history.update(torch.tensor([1.0, 1.0, 0.0, 0.0]), [10, 10, 20, 20])
    assert first.tolist() == [[1.0, 1.0]] * 4  # nothing seen: strength 2 at 1/2
    second = history.update(torch.tensor([1.0, 0.0, 1.0, 0.0]), [10, 10, 30, 30])
    # The mean seen is 1/2, so the prior is (1, 1); prompt 10 adds its 2 successes.
    assert second.tolist() == [[3.0, 1.0], [3.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    result = hadw_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=2, estimator="prompt_history",
                             prior=second)
    # b of prompt 10's success: (3 + 0) / (3 + 1 + 1) = 3/5; of its failure (3 + 1) / 5;
    # prompt 30's, from the prior alone: 1/3 and 2/3.
    assert result.tolist() == pytest.approx([0.4, -0.8, 2 / 3, -2 / 3])


# --- against the float64 reference --------------------------------------------------------


def _random_batch(generator, groups, size):
    rewards = (torch.rand(groups * size, generator=generator, dtype=torch.float64) < 0.4).double()
    labels = torch.arange(groups).repeat_interleave(size)
    order = torch.randperm(groups * size, generator=generator)
    return rewards[order], (labels * 7 + 3)[order]


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("estimator", BATCH_ESTIMATORS)
def test_matches_reference_on_shuffled_batches(estimator, size):
    generator = torch.Generator().manual_seed(size)
    rewards, labels = _random_batch(generator, 6, size)
    result = hadw_advantages(rewards, group_index=labels, estimator=estimator, normalize_std=False)
    expected = reference.advantages(rewards.tolist(), labels.tolist(), estimator)
    assert result.tolist() == pytest.approx(expected, abs=1e-12)
    # Contiguous groups give the same numbers as their index.
    order = torch.argsort(labels, stable=True)
    contiguous = hadw_advantages(rewards[order], group_size=size, estimator=estimator, normalize_std=False)
    assert contiguous.tolist() == pytest.approx(result[order].tolist(), abs=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATOR_NAMES)
def test_phi_composes_with_every_estimator(estimator):
    generator = torch.Generator().manual_seed(3)
    rewards, labels = _random_batch(generator, 5, 4)
    priors = [(1.0 + key % 3, 2.0) for key in labels.tolist()] if estimator == "prompt_history" else None
    prior = torch.tensor(priors, dtype=torch.float64) if priors else None
    result = hadw_advantages(rewards, group_index=labels, estimator=estimator, normalize_std=False, anchor=0.3,
                             lambda_scale=1.3, prior=prior)
    expected = reference.advantages(rewards.tolist(), labels.tolist(), estimator, priors=priors, anchor=0.3,
                                    lambda_scale=1.3)
    assert result.tolist() == pytest.approx(expected, abs=1e-12)


def test_float32_rewards_agree_with_float64():
    generator = torch.Generator().manual_seed(5)
    rewards, labels = _random_batch(generator, 8, 4)
    for estimator in BATCH_ESTIMATORS:
        low = hadw_advantages(rewards.float(), group_index=labels, estimator=estimator, normalize_std=False)
        high = hadw_advantages(rewards, group_index=labels, estimator=estimator, normalize_std=False)
        assert low.dtype == torch.float32
        assert torch.allclose(low.double(), high, atol=1e-6)


def test_history_matches_its_replay_over_many_batches():
    generator = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(6):
        keys = torch.randint(0, 5, (4,), generator=generator).repeat_interleave(3).tolist()
        rewards = (torch.rand(12, generator=generator) < 0.5).double().tolist()
        batches.append((rewards, keys))
    history = PromptHistory(discount=0.7, prior_strength=1.5)
    reads = [history.update(torch.tensor(rewards), keys) for rewards, keys in batches]
    expected = reference.history_replay(batches, 0.7, 1.5)
    for read, want in zip(reads, expected):
        assert torch.allclose(read, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_history_state_round_trips_and_refuses_another_discount():
    history = PromptHistory(discount=0.8)
    history.update(torch.tensor([1.0, 0.0, 1.0, 1.0]), [prompt_key([1, 2]), prompt_key([1, 2]), 5, 5])
    restored = PromptHistory(discount=0.8)
    restored.load_state_dict(history.state_dict())
    assert restored.read([5, 6]).tolist() == history.read([5, 6]).tolist()
    with pytest.raises(ValueError, match="saved with"):
        PromptHistory(discount=0.9).load_state_dict(history.state_dict())
    with pytest.raises(ValueError, match="malformed"):
        broken = history.state_dict()
        broken["prompts"][0][1] = -1.0
        PromptHistory(discount=0.8).load_state_dict(broken)


def test_prompt_key_is_stable_and_takes_tensors():
    assert prompt_key([3, 4, 5]) == prompt_key(torch.tensor([3, 4, 5])) != prompt_key([3, 4, 6])
    assert 0 <= prompt_key("a prompt") < 2 ** 63


def test_a_text_never_shares_a_token_list_s_key_and_token_keys_stay_as_saved():
    assert prompt_key("1,2,3") != prompt_key([1, 2, 3]) and prompt_key("") != prompt_key([])
    # The key a history saved before texts were tagged holds for these ids.
    assert prompt_key([1, 2, 3]) == prompt_key(np.array([1, 2, 3])) == 1517167407554927345


@pytest.mark.parametrize("tokens", [[1.5, 2.0], torch.tensor([1.0, 2.0]), b"\x01\x02", [True, False], 7])
def test_prompt_key_refuses_what_is_neither_token_ids_nor_text(tokens):
    with pytest.raises(TypeError, match="^prompt_key takes integer token ids or a str"):
        prompt_key(tokens)


def test_a_history_none_of_whose_keys_recurs_warns_once():
    history = PromptHistory()
    with pytest.warns(UserWarning, match="no prompt key has recurred in 20 rollout batches") as caught:
        for step in range(40):
            history.update(torch.tensor([1.0, 0.0]), [step, step])  # a new key every batch: verl's uids
    assert len([w for w in caught if "recurred" in str(w.message)]) == 1
    recurring = PromptHistory()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(40):
            recurring.update(torch.tensor([1.0, 0.0]), [step % 10, step % 10])
    # Restored, a history that has seen a key recur stays quiet.
    restored = PromptHistory()
    restored.load_state_dict(recurring.state_dict())
    assert restored.state_dict() == recurring.state_dict()


def test_a_version_1_history_still_loads_with_its_token_keys():
    history = PromptHistory(discount=0.8)
    history.update(torch.tensor([1.0, 0.0, 1.0, 1.0]), [prompt_key([1, 2, 3])] * 2 + [5, 5])
    saved = history.state_dict()
    old = {key: value for key, value in saved.items() if key != "recurred"} | {"version": 1}
    restored = PromptHistory(discount=0.8)
    with pytest.warns(UserWarning, match="version-1 PromptHistory state: prompts keyed by prompt_key\\(text\\)"):
        restored.load_state_dict(old)
    assert restored.read([prompt_key([1, 2, 3]), 5]).tolist() == history.read([prompt_key([1, 2, 3]), 5]).tolist()
    with pytest.raises(ValueError, match="not a PromptHistory state of version 1 or 2"):
        restored.load_state_dict({**saved, "version": 3})


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("call, error, match", [
    (lambda r: hadw_advantages(r, group_size=2, estimator="rloo", normalize_std=True), ValueError, "normalize_std=False"),
    (lambda r: hadw_advantages(r, group_size=2, estimator="median"), ValueError, "estimator must be one of"),
    (lambda r: hadw_advantages(r, group_size=2, estimator="prompt_history"), ValueError, "needs prior"),
    (lambda r: hadw_advantages(r, group_size=2, prior=torch.ones(4, 2)), ValueError, "history estimators only"),
    (lambda r: hadw_advantages(r, group_size=2, estimator="prompt_history", prior=torch.ones(3, 2)), ValueError,
     r"prior must be \[4, 2\]"),
    (lambda r: hadw_advantages(r, group_size=2, estimator="prompt_history", prior=-torch.ones(4, 2)), ValueError,
     "non-negative"),
    (lambda r: hadw_advantages(r * 2, group_size=2, estimator="prompt_history", prior=torch.ones(4, 2)), ValueError,
     r"\[0, 1\]"),
    (lambda r: hadw_advantages(r, group_size=3, estimator="james_stein"), ValueError, "do not split"),
    # Inputs the estimator would read wrong, or that contradict another.
    (lambda r: hadw_advantages(r, group_size=2, estimator="prompt_history",
                               prior=torch.tensor([[1.0, 1.0], [2.0, 1.0], [1.0, 3.0], [1.0, 3.0]])), ValueError,
     "^prior's rows differ within a group"),
    (lambda r: hadw_advantages(r, group_index=[0, 1, 0, 1], estimator="prompt_history",
                               prior=torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 3.0], [1.0, 3.0]])), ValueError,
     "^prior's rows differ within a group"),
    (lambda r: hadw_advantages(r, group_size=2.0), TypeError, "^group_size must be an int, got 2.0"),
    (lambda r: hadw_advantages(r, group_size=True), TypeError, "^group_size must be an int, got True"),
    (lambda r: fused_hadw_grpo_loss(torch.zeros(4, 3), None, None, torch.ones(4, 3), advantages=r,
                                    advantage_estimator="rloo"), ValueError,
     "^advantage_estimator='rloo' forms the advantages from rewards; advantages= are formed already"),
])
def test_refusals_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.tensor([1.0, 0.0, 1.0, 1.0]))


@pytest.mark.parametrize("options, match", [
    ({"discount": 0.0}, "discount"), ({"discount": 1.5}, "discount"), ({"prior_strength": -1.0}, "prior_strength"),
    ({"discount": float("nan")}, "discount"),
])
def test_history_options_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        PromptHistory(**options)


def test_the_history_names_its_own_need_for_unit_rewards_and_refuses_a_state_with_a_key_twice():
    history = PromptHistory()
    with pytest.raises(ValueError, match=r"^rewards must lie in \[0, 1\]: the history counts them as its Beta "
                                         "posterior's successes"):
        history.update(torch.tensor([2.0, 0.0]), [1, 1])
    history.update(torch.tensor([1.0, 0.0, 1.0, 1.0]), [1, 1, 2, 2])
    state = history.state_dict()
    state["prompts"][1][0] = state["prompts"][0][0]
    with pytest.raises(ValueError, match="malformed"):
        PromptHistory().load_state_dict(state)


def test_history_update_refuses_bad_keys():
    history = PromptHistory()
    with pytest.raises(ValueError, match="prompt_keys has 1"):
        history.update(torch.tensor([1.0, 0.0]), [1])
    with pytest.raises(TypeError, match="integers"):
        history.update(torch.tensor([1.0, 0.0]), [1.5, 2.5])
    with pytest.raises(TypeError, match="integer tensor"):
        history.update(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 2.0]))
    assert history.step == 0 and len(history) == 0  # nothing folded in


# --- James-Stein inside a fused loss -------------------------------------------------------


def _loss_batch(responses, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(responses, 5, generator=generator, dtype=torch.float64) * 0.1 - 1
    old = logprobs + torch.randn(responses, 5, generator=generator, dtype=torch.float64) * 0.05
    rewards = torch.rand(responses, generator=generator, dtype=torch.float64)
    return logprobs, old, rewards, torch.ones(responses, 5)


def test_a_micro_batch_shrinks_over_the_whole_batch_given_its_totals():
    logprobs, old, rewards, mask = _loss_batch(12)
    whole = hadw_advantages(rewards, group_size=3, estimator="james_stein", anchor=0.4)
    totals = batch_totals(rewards, group_size=3)
    for rows in (slice(0, 6), slice(6, 9)):  # two groups, and one
        given = fused_hadw_grpo_loss(logprobs[rows], old[rows], rewards[rows], mask[rows], group_size=3,
                                     advantage_estimator="james_stein", anchor=0.4, batch_totals=totals)
        expected = fused_hadw_grpo_loss(logprobs[rows], old[rows], None, mask[rows], advantages=whole[rows])
        torch.testing.assert_close(given, expected)
    # The whole batch in one call: its own groups are the batch, with or without the totals.
    torch.testing.assert_close(
        fused_hadw_grpo_loss(logprobs, old, rewards, mask, group_size=3, advantage_estimator="james_stein",
                             batch_totals=totals),
        fused_hadw_grpo_loss(logprobs, old, rewards, mask, group_size=3, advantage_estimator="james_stein"))


def test_totals_add_over_parts_of_the_batch():
    _, _, rewards, _ = _loss_batch(12)
    parts = batch_totals(rewards[:6], group_size=3) + batch_totals(rewards[6:], group_size=3)
    torch.testing.assert_close(parts, batch_totals(rewards, group_size=3))
    labels = torch.arange(4).repeat_interleave(3).flip(0)
    torch.testing.assert_close(batch_totals(rewards, group_index=labels), batch_totals(rewards, group_size=3))


@pytest.mark.parametrize("linear", [False, True])
def test_a_one_group_call_is_not_silently_rloo(linear):
    logprobs, old, rewards, mask = _loss_batch(3)
    with pytest.raises(ValueError, match="^advantage_estimator='james_stein' reads the batch's other groups "
                                         "and this call holds 1: pass batch_totals"):
        if linear:
            hidden = torch.randn(3, 5, 4, dtype=torch.float64)
            fused_linear_hadw_grpo_loss(hidden, torch.randn(7, 4, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.long),
                                        old, rewards, mask, group_size=3, advantage_estimator="james_stein")
        else:
            fused_hadw_grpo_loss(logprobs, old, rewards, mask, group_size=3, advantage_estimator="james_stein")


@pytest.mark.parametrize("options, match", [
    (dict(advantage_estimator="rloo"), "^batch_totals are read by advantage_estimator='james_stein' only, not 'rloo'"),
    (dict(advantage_estimator="james_stein", totals=torch.zeros(5, dtype=torch.float64)),
     r"^batch_totals must be \[6\]"),
    (dict(advantage_estimator="james_stein", totals="part"),
     "^batch_totals must be finite and count this call's 2 groups and 6 responses among two groups or more, got 1 "
     "groups"),
    (dict(advantage_estimator="james_stein", totals=torch.tensor([4.0, 12, 6, 1, 2, float("nan")])),
     "^batch_totals must be finite"),
    (dict(advantage_estimator="james_stein", advantages=True), "^batch_totals are read by"),
])
def test_batch_totals_that_contradict_the_call_are_refused(options, match):
    logprobs, old, rewards, mask = _loss_batch(12)
    totals = options.pop("totals", batch_totals(rewards, group_size=3))
    if isinstance(totals, str):
        totals = batch_totals(rewards[:3], group_size=3)
    if options.pop("advantages", False):
        options.update(advantages=torch.zeros(6, dtype=torch.float64))
        rewards = None
    with pytest.raises(ValueError, match=match):
        fused_hadw_grpo_loss(logprobs[:6], old[:6], None if rewards is None else rewards[:6], mask[:6],
                             group_size=3, batch_totals=totals, **options)


# --- under torch.distributed ---------------------------------------------------------------


def _james_stein_on_rank(rank):
    logprobs, old, rewards, mask = _loss_batch(12)
    rows = slice(6 * rank, 6 * rank + 6)
    try:
        fused_hadw_grpo_loss(logprobs[rows], old[rows], rewards[rows], mask[rows], group_size=3,
                             advantage_estimator="james_stein")
        refusal = None
    except ValueError as error:
        refusal = str(error)
    totals = batch_totals(rewards[rows], group_size=3, all_reduce=True)
    given = fused_hadw_grpo_loss(logprobs[rows], old[rows], rewards[rows], mask[rows], group_size=3,
                                 advantage_estimator="james_stein", batch_totals=totals)
    whole = hadw_advantages(rewards, group_size=3, estimator="james_stein")
    expected = fused_hadw_grpo_loss(logprobs[rows], old[rows], None, mask[rows], advantages=whole[rows])
    return refusal, float(given), float(expected)


@pytest.mark.slow
def test_under_ddp_james_stein_needs_the_whole_batch_s_totals():
    for refusal, given, expected in on_ranks(_james_stein_on_rank).values():
        assert refusal.startswith("advantage_estimator='james_stein' under torch.distributed would read "
                                  "this rank's groups alone")
        assert given == pytest.approx(expected, rel=1e-12)



def _history_on_rank(rank):
    history = PromptHistory(discount=0.5)
    shards = [([1.0, 1.0, 0.0, 1.0], [1, 1, 2, 2]), ([0.0, 0.0], [1, 1])]
    rewards, keys = shards[rank]
    history.update(torch.tensor(rewards), keys)
    return history.state_dict(), history.update(torch.tensor(rewards), keys).tolist()


@pytest.mark.slow
def test_every_rank_holds_the_whole_batchs_history():
    results = on_ranks(_history_on_rank)
    assert results[0][0] == results[1][0]
    # Prompt 1 was seen with 2 successes (rank 0) and 2 failures (rank 1); the mean of all
    # six rewards is 1/2, so its prior reads (1 + 2, 1 + 2) on both ranks.
    assert results[0][1][0] == results[1][1][0] == [3.0, 3.0]


# --- the history inside a fused loss -------------------------------------------------------


@pytest.mark.parametrize("linear", [False, True])
def test_a_fused_loss_reads_the_history_s_prior_as_hadw_advantages_does(linear):
    logprobs, old, rewards, mask = _loss_batch(12)
    rewards = (rewards > 0.5).double()
    history = PromptHistory()
    history.update(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0]), [7, 7, 8, 8, 9, 9])
    prior = history.update(rewards, [7] * 3 + [8] * 3 + [9] * 3 + [10] * 3)
    expected = hadw_advantages(rewards, group_size=3, estimator="prompt_history", prior=prior, anchor=0.4)
    if linear:
        hidden, weight = torch.randn(12, 5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
        labels = torch.randint(0, 7, (12, 5))
        given = fused_linear_hadw_grpo_loss(hidden, weight, labels, old, rewards, mask, group_size=3, anchor=0.4,
                                            advantage_estimator="prompt_history", prior=prior)
        formed = fused_linear_hadw_grpo_loss(hidden, weight, labels, old, None, mask, advantages=expected)
    else:
        given = fused_hadw_grpo_loss(logprobs, old, rewards, mask, group_size=3, anchor=0.4,
                                     advantage_estimator="prompt_history", prior=prior)
        formed = fused_hadw_grpo_loss(logprobs, old, None, mask, advantages=expected)
    torch.testing.assert_close(given, formed)


@pytest.mark.parametrize("options, match", [
    (dict(advantage_estimator="prompt_history"), "^estimator='prompt_history' needs prior"),
    (dict(advantage_estimator="rloo", prior=torch.ones(6, 2)), "^prior is read by the history estimators only"),
    (dict(advantage_estimator="prompt_history", prior=torch.ones(5, 2)), r"^prior must be \[6, 2\]"),
    (dict(advantage_estimator="prompt_history", prior=torch.tensor([[1.0, 1]] * 3 + [[1.0, 2]] * 2 + [[2.0, 1]])),
     "^prior's rows differ within a group"),
    (dict(advantage_estimator="prompt_history", prior=torch.full((6, 2), float("inf"))), "^prior's pseudo-counts"),
    (dict(advantage_estimator="prompt_history", prior=torch.ones(6, 2), rewards=2.0), r"^rewards must lie in \[0, 1\]"),
    (dict(prior=torch.ones(6, 2), advantages=True), "^prior is read by advantage_estimator='prompt_history'"),
])
def test_a_fused_loss_refuses_a_prior_that_contradicts_the_call(options, match):
    logprobs, old, rewards, mask = _loss_batch(6)
    options = dict(options)
    rewards = (rewards > 0.5).double() * options.pop("rewards", 1.0)
    if options.pop("advantages", False):
        call = dict(rewards=None, advantages=torch.ones(6))
    else:
        call = dict(rewards=rewards, group_size=3)
    with pytest.raises((ValueError, TypeError), match=match):
        fused_hadw_grpo_loss(logprobs, old, response_mask=mask, **call, **options)


@pytest.mark.parametrize("backend", [name for name in available_backends("cpu") if name != "torch"])
@pytest.mark.parametrize("estimator", ESTIMATOR_NAMES)
def test_each_kernel_forms_each_estimator_at_an_odd_group_size_from_strided_inputs(backend, estimator):
    """G = 3 (a block of the group wider than it, in Triton) and inputs that are views with
    strides: the rewards every other element of a buffer, the prior column-major. The
    kernels' loss, gradient and metrics are the reference's."""
    logprobs, old, rewards, mask = _loss_batch(9, seed=3)
    mask[4, 2:] = 0
    rewards = torch.stack([(rewards > 0.4).double(), torch.zeros(9, dtype=torch.float64)], 1)[:, 0]
    rewards[:3] = 1.0  # an all-equal group
    inputs = {}
    if ESTIMATORS[estimator].scope == "history":
        inputs["prior"] = (0.5 + torch.rand(3, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                           ).repeat_interleave(3, 0).t().contiguous().t()
        assert inputs["prior"].stride() == (1, 9)
    assert rewards.stride() == (2,)
    runs = {}
    for name in ("torch", backend):
        leaf = logprobs.clone().requires_grad_()
        loss, metrics = fused_hadw_grpo_loss(leaf, old, rewards, mask, group_size=3, anchor=0.55, loss_type="dapo",
                                             advantage_estimator=estimator, return_metrics=True, backend=name,
                                             **inputs)
        loss.backward()
        runs[name] = (loss, leaf.grad, metrics)
    torch.testing.assert_close(runs[backend][0], runs["torch"][0])
    torch.testing.assert_close(runs[backend][1], runs["torch"][1])
    assert list(runs[backend][2]) == list(runs["torch"][2])
    for name, value in runs["torch"][2].items():
        torch.testing.assert_close(runs[backend][2][name], value, msg=name)
