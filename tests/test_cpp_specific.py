"""What only the C++ kernels (csrc/, the "cpp" backend) must hold. Their agreement with
the reference runs in the conformance suite, on every backend; here: results that do not
depend on the thread count, the op contracts (torch.library.opcheck) of the hadw_cpp::
kernels, the shared logits buffer under concurrent calls, the LM head's gradient memory
kept between calls, the generated constants header, the extension's loading, and
setup.py's build modes."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hadw_kernels import fused_hadw_grpo_loss
from hadw_kernels.backends import cpp_backend, cpp_constants, cpp_declarations
from hadw_kernels.config import loss_config as config
from hadw_kernels.config import presets
from hadw_kernels.objectives import table as objective_table
from hadw_kernels.ops import signatures
from hadw_kernels.tables import aggregations as aggregation_table
from hadw_kernels.tables import linear_blocks, metrics

ROOT = Path(__file__).resolve().parents[1]
IGNORE = linear_blocks.IGNORE_INDEX

needs_extension = pytest.mark.skipif(
    cpp_backend._UNAVAILABLE is not None, reason=f"C++ extension unavailable: {cpp_backend._UNAVAILABLE}"
)


@pytest.fixture
def at_one_and_two_threads():
    """Runs a call at one thread, then at two, and returns both results; restores the
    thread count."""
    before = torch.get_num_threads()

    def run(call):
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(call())
        return results

    yield run
    torch.set_num_threads(before)


# --- inputs ---------------------------------------------------------------------------------


def _op_arguments(op: str, **named) -> tuple:
    """``named`` in the order of the hadw_cpp:: kernel's arguments (ops/signatures.py)."""
    return tuple(named[name] for _, name in cpp_declarations.parse(signatures.SIGNATURES[op][0]))


def _surrogate_args(dtype=torch.float32, *, batch=16, width=300, advantages=False, options=True, loss_type="dapo",
                    estimator_inputs=None, **loss_options):
    """hadw_cpp::surrogate_loss arguments: ``batch`` segments of 0 to 2 x ``width``
    tokens (one empty), masked tokens; the caller's per-token advantages or rewards; KL,
    per-token importance weights and entropy (options=True). The objective and its
    ratio form are ``loss_type``'s, with ``loss_options`` (a LossConfig; dual clip 3 with
    options=True where the objective is clip); ``estimator_inputs``, the batch totals or the
    prior an ``advantage_estimator`` among them reads."""
    lengths = torch.randint(0, 2 * width + 1, (batch,))
    lengths[1] = 0
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = int(cu_seqlens[-1])
    logprobs = -torch.rand(tokens, dtype=torch.float64) * 3
    mask = torch.rand(tokens) > 0.2
    if options and presets.LOSS_PRESETS[loss_type].objective == "clip":
        loss_options.setdefault("dual_clip", 3.0)
    loss = config.LossConfig.build(loss_type, None if advantages else 4, beta=0.05 if options else None,
                                   entropy_coef=0.01 if options else None, **loss_options)
    return _op_arguments(
        "surrogate_loss",
        logprobs=logprobs.to(dtype), old_logprobs=(logprobs + 0.3 * torch.randn_like(logprobs)).to(dtype),
        response_mask=mask, cu_seqlens=cu_seqlens,
        rewards=None if advantages else torch.randint(0, 2, (batch,)).float(),
        advantages=torch.randn(tokens) if advantages else None, response_advantages=None,
        anchor=None if advantages else torch.tensor(0.4, dtype=torch.float64),
        ref_logprobs=(logprobs + 0.1 * torch.randn_like(logprobs)).to(dtype) if options else None,
        importance_weights=(torch.rand(tokens) + 0.5).to(dtype) if options else None,
        entropy=torch.rand(tokens).to(dtype) if options else None, selected=None,
        **{"batch_totals": None, "prior": None, **(estimator_inputs or {})}, **loss.kernel_options(),
    )


def _linear_tensors(rows, hidden, vocab, dtype=torch.float32, bias=True):
    h = torch.randn(rows, hidden, dtype=torch.float64)
    w = torch.randn(vocab, hidden, dtype=torch.float64) / hidden**0.5
    b = torch.randn(vocab, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, (rows,))
    labels[1::7] = IGNORE
    return h.to(dtype), w.to(dtype), None if b is None else b.to(dtype), labels


def _linear_surrogate_args(rows, hidden, vocab, dtype=torch.float32, *, entropy_coef=0.0, block_rows=0,
                           options=True, loss_type="dapo", **loss_options):
    """hadw_cpp::linear_surrogate_forward arguments; a third of the tokens are clipped
    (zero gradient: compacted out of the gradient GEMMs). The objective is ``loss_type``'s,
    with ``loss_options`` (dual clip 2 with options=True where it is clip)."""
    h, w, b, labels = _linear_tensors(rows, hidden, vocab, dtype)
    accumulate = torch.promote_types(dtype, torch.float32)
    old = -torch.rand(rows, dtype=accumulate) * 8
    advantages = torch.randn(rows, dtype=accumulate)
    advantages[::3] = 0.0
    if options and presets.LOSS_PRESETS[loss_type].objective == "clip":
        loss_options.setdefault("dual_clip", 2.0)
    loss = config.LossConfig.build(loss_type, beta=0.05 if options else None, kl_estimator="k2",
                                   entropy_coef=entropy_coef, **loss_options)
    return _op_arguments(
        "linear_surrogate_forward",
        hidden=h, weight=w, bias=b, labels=labels, old_logprobs=old if options else None, advantages=advantages,
        agg_weights=torch.full((rows,), 1.0 / rows, dtype=accumulate),
        ref_logprobs=old + 0.1 * torch.randn_like(old) if options else None,
        importance_weights=torch.rand(rows, dtype=accumulate) + 0.5 if options else None,
        temperature=0.8, ignore_index=IGNORE, **loss.token_options(), with_entropy=True, block_rows=block_rows,
    )


def _linear_surrogate(*args):
    """The C++ kernel through the routed op: block_rows 0 is resolved to the default
    there (linear_blocks.block_rows_for, backends/cpp_backend.py)."""
    return torch.ops.hadw.linear_surrogate_forward(*args, "cpp")


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _assert_bit_identical(first, second):
    for index, (a, b) in enumerate(zip(_outputs(first), _outputs(second))):
        assert a.shape == b.shape and a.dtype == b.dtype, index
        assert torch.equal(a, b), f"output {index} differs: max difference {(a.double() - b.double()).abs().max()}"


# --- thread count ---------------------------------------------------------------------------


# (loss type, options, the caller's per-token advantages): each ratio form, the sequence
# form's per-response sums (the share of d l / d rho under per-token importance weights,
# GMPO's clipped log-ratios) and VESPO's summed log-ratio weight.
THREAD_COUNT_CASES = [
    pytest.param("dapo", {}, False, id="token-clip"),
    pytest.param("gspo", {}, False, id="gspo_token-clip"),
    pytest.param("luspo", {}, True, id="sequence-clip-token_advantages"),
    pytest.param("gmpo", {}, True, id="sequence-gmpo-token_advantages"),
    pytest.param("vespo", {}, False, id="sequence-vespo"),
    pytest.param("sapo", {"ratio_level": "sequence"}, False, id="sequence-sapo"),
]


@needs_extension
@pytest.mark.parametrize("loss_type, options, advantages", THREAD_COUNT_CASES)
def test_surrogate_does_not_depend_on_thread_count(at_one_and_two_threads, loss_type, options, advantages):
    """Responses are summed in response order, whichever thread ran them; a response's
    own sums (its ratio, its share of the gradient) are one task's. Per-token importance
    weights throughout."""
    args = _surrogate_args(batch=64, advantages=advantages, loss_type=loss_type, **options)
    _assert_bit_identical(*at_one_and_two_threads(lambda: torch.ops.hadw_cpp.surrogate_loss(*args)))


# --- ties and bounds ---------------------------------------------------------------------

# Per response: exact (dyadic) log-ratios and per-token advantages on the edges of the
# objectives' derivatives. Ratio 1 on both ends of a zero-width clip range and at delta = 1
# (ties of the clip's branches); log-ratios on GMPO's bounds +-0.25, with advantages of
# either sign and 0; a mean log-ratio exactly at the clamp's +-20 (its gradient passes)
# and beyond it (none); ratio 2 (exp(log 2) is 2 in fp64) at the dual clip's bound 2.
EDGE_LOG_RATIOS = [[0.0] * 6, [0.25, -0.25, 0.5, -0.5, 0.25, -0.25], [20.0] * 6, [-20.0] * 6, [20.5] * 6,
                   [0.25, 0.25, 0.25, -0.25, -0.25, -0.25], [math.log(2)] * 6]
EDGE_ADVANTAGES = [[1.0, -1.0, 0.0, 1.0, -1.0, 0.0], [1.0, -1.0, 1.0, -1.0, -1.0, 1.0], [-1.0] * 6, [1.0] * 6,
                   [-1.0] * 6, [1.0, -1.0, 0.0, 0.0, -1.0, 1.0], [-1.0] * 6]
EDGE_CASES = [
    pytest.param("grpo", dict(epsilon_low=0.0, epsilon_high=0.0, dual_clip=2.0), id="clip-zero_range-dual_clip_tie"),
    pytest.param("grpo", dict(epsilon_low=0.0, epsilon_high=0.0, delta=1.0), id="clip-delta_tie"),
    pytest.param("grpo", dict(epsilon_low=0.0, epsilon_high=0.0, objective="cispo_clip"), id="cispo_clip"),
    pytest.param("gmpo", dict(epsilon_low=0.25, epsilon_high=0.25), id="gmpo-bounds"),
    pytest.param("luspo", dict(epsilon_low=0.0, epsilon_high=0.0), id="sequence-clamp_bound"),
    pytest.param("gspo", dict(epsilon_low=0.0, epsilon_high=0.0), id="gspo_token-clamp_bound"),
    pytest.param("sapo", dict(ratio_level="sequence"), id="sapo-sequence"),
    pytest.param("vespo", {}, id="vespo"),
]


@needs_extension
@pytest.mark.parametrize("loss_type, options", EDGE_CASES)
def test_ties_and_bounds_follow_the_reference(loss_type, options):
    """The derivative's conventions where they decide (each row's slope: half of the
    gradient through each branch at a tie, a clamp passing it on its closed interval),
    and the clip fractions' strict bounds, as the reference's, in fp64 where the edges
    are exact. Per-token importance weights throughout."""
    log_ratio = torch.tensor(EDGE_LOG_RATIOS, dtype=torch.float64)
    logprobs = torch.full_like(log_ratio, -1.0)
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    mask[5, 4:] = False
    weights = torch.linspace(0.5, 1.5, log_ratio.numel(), dtype=torch.float64).view_as(log_ratio)
    results = {}
    for backend in ("cpp", "torch"):
        leaf = logprobs.clone().requires_grad_()
        loss, metrics = fused_hadw_grpo_loss(
            leaf, logprobs - log_ratio, None, mask, advantages=torch.tensor(EDGE_ADVANTAGES, dtype=torch.float64),
            importance_weights=weights, loss_type=loss_type, **options, return_metrics=True, backend=backend,
            check_values=False,
        )
        (loss * 0.7).backward()
        results[backend] = (loss.detach(), leaf.grad, metrics)
    (loss, grad, metrics), (expected_loss, expected_grad, expected_metrics) = results["cpp"], results["torch"]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert torch.any(grad != 0)
    for name in expected_metrics:
        torch.testing.assert_close(metrics[name], expected_metrics[name], rtol=1e-6, atol=0)


@needs_extension
def test_linear_logprobs_do_not_depend_on_thread_count(at_one_and_two_threads):
    """The vocabulary slabs, and the order their partial results are combined in, are
    fixed by the vocabulary size, not by the thread count. 2600 columns: 11 tiles of the
    recompute path; 700 rows: two blocks."""
    h, w, b, labels = _linear_tensors(700, 32, 2600)
    grad_logprobs, grad_entropy = torch.randn(700), torch.randn(700)

    def forward_and_backward():
        forward = torch.ops.hadw_cpp.linear_logprob_forward(h, w, b, labels, 0.7, IGNORE, True)
        backward = torch.ops.hadw_cpp.linear_logprob_backward(grad_logprobs, grad_entropy, h, w, b, labels,
                                                              forward[2], forward[3], 0.7, IGNORE)
        return (*forward, *backward)

    _assert_bit_identical(*at_one_and_two_threads(forward_and_backward))


@needs_extension
@pytest.mark.parametrize("entropy_coef", [0.0, 0.02], ids=["numerators", "logits"])
def test_linear_surrogate_does_not_depend_on_thread_count(at_one_and_two_threads, entropy_coef):
    """9000 columns: 5 tiles of the gradients-in-forward path; block_rows 128: 5 blocks,
    each with clipped rows compacted out of the gradient GEMMs."""
    args = _linear_surrogate_args(600, 32, 9000, entropy_coef=entropy_coef, block_rows=128)
    _assert_bit_identical(*at_one_and_two_threads(lambda: _linear_surrogate(*args)))


@needs_extension
def test_block_rows_only_round_differently():
    """The block size changes which rows share a grad_weight GEMM, so only rounding."""
    args = _linear_surrogate_args(300, 16, 3000, block_rows=7)
    small = _linear_surrogate(*args)
    default = _linear_surrogate(*args[:-1], 0)
    for a, b in zip(small, default):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_extension
def test_default_blocks_are_config_block_rows_for():
    """The default blocks are linear_blocks.block_rows_for's on "cpu" over the N rows, resolved in
    Python without reading how many rows are active, and passed to the kernel: 1500 rows
    plan blocks of 768, and the kernel runs the 1285 active ones as 768 + 517. Other block
    sizes round grad_weight differently, so bit-identity pins the choice."""
    args = _linear_surrogate_args(1500, 16, 300)
    expected = linear_blocks.block_rows_for(1500, 300, 4, "cpu")
    assert expected == 768
    default = _linear_surrogate(*args)
    _assert_bit_identical(default, _linear_surrogate(*args[:-1], expected))
    largest = _linear_surrogate(*args[:-1], linear_blocks.MAX_BLOCK_ROWS["cpu"])
    assert not torch.equal(default[3], largest[3])


@needs_extension
def test_the_kernels_refuse_a_ratio_form_the_objective_lacks():
    """objectives.table.OBJECTIVES' ratio forms, compiled in: GPG has no sequence ratio, and the
    linear gradients-in-forward kernel serves no objective that reads its whole response
    (the losses route those to the recompute path)."""
    args = dict(zip((name for _, name in cpp_declarations.parse(signatures.SIGNATURES["surrogate_loss"][0])),
                    _surrogate_args(batch=4, width=5, loss_type="gpg")))
    args["ratio_level"] = objective_table.RATIO_LEVELS.index("sequence")
    gpg = objective_table.OBJECTIVE_NAMES.index("gpg")
    with pytest.raises(RuntimeError, match=f"objective {gpg} does not take ratio_level {args['ratio_level']}"):
        torch.ops.hadw_cpp.surrogate_loss(*_op_arguments("surrogate_loss", **args))
    for loss_type in ("gmpo", "vespo"):
        with pytest.raises(RuntimeError, match="has no token ratio form .* use the recompute path"):
            _linear_surrogate(*_linear_surrogate_args(30, 16, 300, loss_type=loss_type, block_rows=8))


@needs_extension
def test_the_kernel_takes_its_blocks_from_python():
    """The C++ kernel has no default of its own (one formula, in linear_blocks.py)."""
    with pytest.raises(RuntimeError, match="block_rows must be positive, got 0"):
        torch.ops.hadw_cpp.linear_surrogate_forward(*_linear_surrogate_args(30, 16, 300))


# --- the shared logits buffer -----------------------------------------------------------------


@needs_extension
def test_concurrent_calls_give_the_serial_results():
    """The logits buffer kept between calls is lent to one call at a time; a call that
    finds it lent takes its own."""
    cases = [_linear_surrogate_args(200, 16, 5000 + 500 * index, entropy_coef=0.01 * (index % 2))
             for index in range(4)]
    serial = [_linear_surrogate(*args) for args in cases]
    concurrent = [None] * len(cases)

    def run(index):
        for _ in range(3):
            concurrent[index] = _linear_surrogate(*cases[index])

    workers = [threading.Thread(target=run, args=(index,)) for index in range(len(cases))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for expected, got in zip(serial, concurrent):
        _assert_bit_identical(expected, got)


# --- the LM head's gradient, its memory kept between calls -------------------------------------


def _rewrites_a_stale_block(call, grad_weight_output: int):
    """call()'s result, from the memory of a grad_weight that an earlier call returned and
    that was freed full of NaN; it must equal a result computed before."""
    expected = call()
    stale = call()[grad_weight_output]
    address = stale.data_ptr()
    stale.fill_(float("nan"))
    del stale
    again = call()
    assert again[grad_weight_output].data_ptr() == address
    _assert_bit_identical(expected, again)
    return again


@needs_extension
@pytest.mark.parametrize("nothing_active", [False, True], ids=["gradients", "no-gradient"])
def test_kept_gradient_memory_is_rewritten_whole(nothing_active):
    """A freed grad_weight's memory serves the next call of its size, which writes all of
    it: the stale values never show, not even where no row has a gradient."""
    args = list(_linear_surrogate_args(60, 16, 700, options=not nothing_active))
    if nothing_active:
        args[5] = torch.zeros_like(args[5])  # zero advantages, no KL, no entropy term
    result = _rewrites_a_stale_block(lambda: _linear_surrogate(*args), 3)
    if nothing_active:
        assert not result[3].any()

    # The recompute path's backward returns its grad_weight from the same memory.
    h, w, b, labels = _linear_tensors(60, 16, 700)
    _, _, lse, mean_logit = torch.ops.hadw_cpp.linear_logprob_forward(h, w, b, labels, 0.8, IGNORE, True)
    upstream = torch.zeros(60) if nothing_active else torch.randn(60)
    backward_args = (upstream, None, h, w, b, labels, lse, mean_logit, 0.8, IGNORE)
    _rewrites_a_stale_block(lambda: torch.ops.hadw_cpp.linear_logprob_backward(*backward_args), 1)


@needs_extension
def test_profiler_sees_the_kept_gradient_live():
    """The profiler's memory view counts grad_weight while it lives, as it would a tensor
    of the CPU allocator's, though its memory was kept from an earlier call."""
    args = _linear_surrogate_args(60, 16, 700)
    _linear_surrogate(*args)  # a block of this size is kept
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        grad_weight = _linear_surrogate(*args)[3]
        del grad_weight
    sizes = [event.nbytes() for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    nbytes = 700 * 16 * 4
    assert nbytes in sizes and -nbytes in sizes


# --- op contracts -----------------------------------------------------------------------------

# The hadw_cpp:: kernels have no autograd formula: their inputs are given without
# requires_grad. Of the routed hadw:: ops only linear_logprob_forward has one (checked with
# requires_grad); the others return their gradients, which the losses attach.
KERNEL_CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@needs_extension
@pytest.mark.parametrize("dtype, advantages, options, loss_type", [
    (torch.float32, False, False, "dapo"), (torch.float32, False, True, "dapo"), (torch.float32, True, True, "gmpo"),
    (torch.bfloat16, False, True, "vespo"), (torch.float64, True, True, "gspo"),
    (torch.float32, False, True, "james_stein"), (torch.float32, False, False, "prompt_history"),
])
def test_opcheck_surrogate(dtype, advantages, options, loss_type):
    estimator = {"james_stein": dict(advantage_estimator="james_stein",
                                     estimator_inputs={"batch_totals": torch.tensor([3.0, 12, 5, 0.4, 1.2, 0.6],
                                                                                    dtype=torch.float64)}),
                 "prompt_history": dict(advantage_estimator="prompt_history",
                                        estimator_inputs={"prior": torch.full((8, 2), 1.5)})}.get(loss_type)
    if estimator is not None:
        loss_type = "dapo"
    args = _surrogate_args(dtype, batch=8, width=5, advantages=advantages, options=options, loss_type=loss_type,
                           **(estimator or {}))
    torch.library.opcheck(torch.ops.hadw_cpp.surrogate_loss.default, args, test_utils=KERNEL_CHECKS)
    torch.library.opcheck(torch.ops.hadw.surrogate_loss.default, (*args, "cpp"), test_utils=KERNEL_CHECKS)


@needs_extension
@pytest.mark.parametrize("dtype, bias_dtype", [(torch.float32, torch.float32), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_opcheck_linear_forward_and_backward(dtype, bias_dtype):
    h, w, b, labels = _linear_tensors(20, 16, 300, dtype, bias=bias_dtype is not None)
    b = None if b is None else b.to(bias_dtype)
    forward_args = (h, w, b, labels, 0.7, IGNORE, True)
    torch.library.opcheck(torch.ops.hadw_cpp.linear_logprob_forward.default, forward_args, test_utils=KERNEL_CHECKS)
    _, _, lse, mean_logit = torch.ops.hadw_cpp.linear_logprob_forward(*forward_args)
    upstream = torch.randn(20, dtype=lse.dtype)
    torch.library.opcheck(
        torch.ops.hadw_cpp.linear_logprob_backward.default,
        (upstream, upstream.flip(0), h, w, b, labels, lse, mean_logit, 0.7, IGNORE), test_utils=KERNEL_CHECKS,
    )
    leaves = [None if t is None else t.clone().requires_grad_() for t in (h, w, b)]
    torch.library.opcheck(torch.ops.hadw.linear_logprob_forward.default, (*leaves, labels, 0.7, IGNORE, True, "cpp"))


@needs_extension
@pytest.mark.parametrize("dtype, entropy_coef, options", [
    (torch.float32, 0.0, True), (torch.float32, 0.02, False), (torch.bfloat16, 0.0, True), (torch.float64, 0.02, True),
])
def test_opcheck_linear_surrogate(dtype, entropy_coef, options):
    args = _linear_surrogate_args(30, 16, 300, dtype, entropy_coef=entropy_coef, block_rows=8, options=options)
    torch.library.opcheck(torch.ops.hadw_cpp.linear_surrogate_forward.default, args, test_utils=KERNEL_CHECKS)
    torch.library.opcheck(torch.ops.hadw.linear_surrogate_forward.default, (*args, "cpp"), test_utils=KERNEL_CHECKS)


@needs_extension
def test_strided_hidden_gets_a_gradient_of_its_layout():
    """The fake implementations promise empty_like(hidden): the kernels keep its strides."""
    h, w, b, labels = _linear_tensors(30, 16, 300)
    strided = h.t().contiguous().t()
    _, _, lse, mean_logit = torch.ops.hadw_cpp.linear_logprob_forward(h, w, b, labels, 0.7, IGNORE, True)
    upstream = torch.randn(30)
    got = torch.ops.hadw_cpp.linear_logprob_backward(upstream, None, strided, w, b, labels, lse, mean_logit, 0.7,
                                                     IGNORE)[0]
    expected = torch.ops.hadw_cpp.linear_logprob_backward(upstream, None, h, w, b, labels, lse, mean_logit, 0.7,
                                                          IGNORE)[0]
    assert got.stride() == strided.stride()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    args = list(_linear_surrogate_args(30, 16, 300))
    args[0] = args[0].t().contiguous().t()
    assert _linear_surrogate(*args)[2].stride() == args[0].stride()


@needs_extension
def test_a_tile_of_minus_infinity_logits():
    """A vocabulary tile whose logits are all -inf (a bias masking it out) adds nothing to
    the log-sum-exp: the log-probs stay finite, as log_softmax's."""
    h, w, _, labels = _linear_tensors(40, 16, 5000, bias=False)
    labels = labels.clamp(min=2048)  # labels outside the masked columns (ignored rows stay ignored)
    labels[1::7] = IGNORE
    bias = torch.zeros(5000)
    bias[:2048] = float("-inf")
    logprobs = torch.ops.hadw_cpp.linear_logprob_forward(h, w, bias, labels, 1.0, IGNORE, True)[0]
    reference = torch.log_softmax(h @ w.t() + bias, dim=-1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    valid = labels != IGNORE
    torch.testing.assert_close(logprobs[valid], reference[valid])
    rows = torch.ones(40)
    token_options = config.LossConfig.build("grpo").token_options()
    result = _linear_surrogate(*_op_arguments(
        "linear_surrogate_forward", hidden=h, weight=w, bias=bias, labels=labels, old_logprobs=None, advantages=rows,
        agg_weights=rows / 40, ref_logprobs=None, importance_weights=None, temperature=1.0, ignore_index=IGNORE,
        **token_options, with_entropy=True, block_rows=16))
    torch.testing.assert_close(result[0][valid], reference[valid])
    assert torch.isfinite(result[2]).all() and torch.isfinite(result[3]).all()


# --- the softmax row loops: AVX-512 and AVX2 kernels, portable loops -------------------


# Row kernels from the widest down; HADW_CPP_ROW_KERNELS caps at one of the narrower.
ROW_KERNELS = ("avx512", "avx2", "portable")


def _widest_row_kernels() -> str:
    if not sys.platform.startswith("linux"):
        return "portable"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "portable"
    line = re.search(r"^flags\s*:(.*)$", flags, re.MULTILINE)
    cpu_flags = set(line.group(1).split()) if line else set()
    if "avx512f" in cpu_flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= cpu_flags else "portable"


def _row_kernels_in_child(env: dict) -> str:
    code = "import hadw_kernels._cpu_kernels as m; print(m.ROW_KERNELS)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _capped_env(cap: str | None) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "HADW_CPP_ROW_KERNELS"}
    return env if cap is None else {**env, "HADW_CPP_ROW_KERNELS": cap}


@pytest.mark.slow
@needs_extension
def test_row_kernels_follow_the_cpu_and_the_switch():
    """The widest row kernels the CPU has run, unless HADW_CPP_ROW_KERNELS caps them."""
    widest = _widest_row_kernels()
    assert _row_kernels_in_child(_capped_env(None)) == widest
    assert _row_kernels_in_child(_capped_env("portable")) == "portable"
    assert _row_kernels_in_child(_capped_env("avx2")) == ("portable" if widest == "portable" else "avx2")
    assert _row_kernels_in_child(_capped_env("avx512")) == widest


@pytest.mark.slow
@needs_extension
@pytest.mark.parametrize("kernels", ROW_KERNELS[1:])
def test_narrower_row_kernels_pass_the_linear_conformance_suite(kernels):
    """Every other test runs the widest row kernels this CPU has; each narrower one (what
    another CPU runs) goes through the linear part of the conformance suite here, in a
    process capped at it."""
    if ROW_KERNELS.index(kernels) <= ROW_KERNELS.index(_widest_row_kernels()):
        pytest.skip(f"this CPU runs the {kernels} row kernels in every other test, or cannot run them")
    env = _capped_env(kernels)
    assert _row_kernels_in_child(env) == kernels
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cpp",
         "tests/conformance/test_linear.py"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", result.stdout), result.stdout[-2000:]


# --- constants generated from the package's tables ---------------------------------------------


def _header_constants(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in re.findall(r"constexpr \w+ (k\w+) = ([-0-9.e]+);", text)}


def test_generated_header_holds_config_values():
    constants = _header_constants(cpp_constants.header(cpp_constants.installed))
    for prefix, names in (("Metric", metrics.METRIC_NAMES), ("Agg", aggregation_table.AGG_MODES),
                          ("Kl", config.KL_ESTIMATORS)):
        assert constants[f"k{prefix}Count"] == len(names)
        for index, name in enumerate(names):
            assert constants[f"k{prefix}{cpp_constants._identifier(name)}"] == index, name
    for prefix, names in (("Objective", objective_table.OBJECTIVE_NAMES), ("RatioLevel", objective_table.RATIO_LEVELS),
                          ("ResponseStep", objective_table.RESPONSE_STEPS)):
        assert constants[f"k{prefix}Count"] == len(names)
        for index, name in enumerate(names):
            assert constants[f"k{prefix}{cpp_constants._identifier(name)}"] == index, name
    steps = re.search(r"kObjectiveResponseStep\[kObjectiveCount\] = \{(.*)\};",
                      cpp_constants.header(cpp_constants.installed)).group(1)
    assert [int(code) for code in steps.split(", ")] == [
        objective_table.RESPONSE_STEPS.index(objective.response_step) for objective in objective_table.OBJECTIVES.values()]
    table = re.search(r"kObjectiveTakesRatioLevel\[kObjectiveCount\]\[kRatioLevelCount\] = \{(.*)\};",
                      cpp_constants.header(cpp_constants.installed)).group(1)
    expected = [[level in objective.ratio_levels for level in objective_table.RATIO_LEVELS]
                for objective in objective_table.OBJECTIVES.values()]
    assert [[flag == "true" for flag in row.split(", ")] for row in re.findall(r"\{([^{}]*)\}", table)] == expected
    assert constants["kLogRatioClamp"] == objective_table.LOG_RATIO_CLAMP
    assert constants["kVespoLogWeightMin"] == objective_table.VESPO_LOG_WEIGHT_MIN
    assert constants["kK3LogRatioClamp"] == config.K3_LOG_RATIO_CLAMP
    assert constants["kK3ValueClamp"] == config.K3_VALUE_CLAMP


@pytest.mark.parametrize("generator", [cpp_constants, cpp_declarations], ids=["constants", "declarations"])
def test_headers_in_the_build_tree_are_current(generator):
    """setup.py's headers (where this checkout was built) are the ones the tables and the
    ops' signatures give now."""
    built = ROOT / "build" / "generated" / generator.HEADER_NAME
    if not built.exists():
        pytest.skip("the extension was not built in this checkout")
    source = cpp_constants.installed if generator is cpp_constants else signatures.SIGNATURES
    assert built.read_text() == generator.header(source)


def test_declarations_follow_the_schemas():
    """Each kernel's generated declaration takes the schema's arguments, in its order,
    with the C++ type of each schema type."""
    text = cpp_declarations.header(signatures.SIGNATURES)
    for op, (arguments, _) in signatures.SIGNATURES.items():
        declared = text.split(f" {op}_cpu(", 1)[1].split(");", 1)[0]
        names = [part.split()[-1] for part in declared.split(",")]
        assert names == [name for _, name in cpp_declarations.parse(arguments)], op
    assert "const std::optional<at::Tensor>& rewards" in text and "std::optional<double> loss_normalizer" in text
    assert "c10::ArrayRef<double> objective_options" in text
    with pytest.raises(ValueError, match=r"no C\+\+ type for the schema type 'str'"):
        cpp_declarations.parse("(Tensor a, str backend)")


@needs_extension
def test_module_was_built_from_this_config():
    import hadw_kernels._cpu_kernels as module

    assert json.loads(module.CONFIG) == cpp_constants.fingerprint(cpp_constants.installed)


@needs_extension
def test_a_module_built_from_another_config_is_refused(monkeypatch):
    monkeypatch.setattr(metrics, "METRIC_NAMES", tuple(reversed(metrics.METRIC_NAMES)))
    assert "built from other hadw_kernels tables" in cpp_backend._load_extension()


@needs_extension
def test_the_module_records_the_signatures_it_was_declared_against():
    import hadw_kernels._cpu_kernels as module

    assert module.SCHEMAS == cpp_declarations.SCHEMA_MARK + cpp_declarations.schema_digest(signatures.SIGNATURES)
    assert cpp_backend._schemas_built_for(module.__file__) == cpp_declarations.schema_digest(signatures.SIGNATURES)


@needs_extension
def test_a_module_built_for_other_op_signatures_is_refused_without_aborting(tmp_path):
    """An extension built before an op's schema changed (an editable install after a pull):
    importing it registered its kernels against the new schemas, and the dispatcher aborted
    the process (SIGABRT) at ``import hadw_kernels``. The backend reads the signatures'
    digest from the module's file first, refuses cpp with a message saying how to rebuild,
    and the torch backend works."""
    import hadw_kernels

    package = tmp_path / "hadw_kernels"
    shutil.copytree(Path(hadw_kernels.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    schema_file = package / "ops" / "signatures.py"
    schema_file.write_text(schema_file.read_text().replace(
        '"bool with_entropy)",\n        "(Tensor logprobs, Tensor entropy, Tensor lse, Tensor mean_logit)"',
        '"bool with_entropy, int? chunk)",\n        "(Tensor logprobs, Tensor entropy, Tensor lse, Tensor mean_logit)"'))
    assert "int? chunk" in schema_file.read_text()
    code = (
        "import torch, hadw_kernels\n"
        "from hadw_kernels.backends import cpp_backend\n"
        "print(hadw_kernels.__file__)\n"
        "print(cpp_backend._UNAVAILABLE)\n"
        "loss = hadw_kernels.fused_hadw_grpo_loss(-torch.rand(4, 3), None, torch.tensor([1.0, 0.0, 1.0, 0.0]),\n"
        "    torch.ones(4, 3), group_size=2)\n"
        "print(hadw_kernels.available_backends(), torch.isfinite(loss).item())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    lines = result.stdout.splitlines()
    assert lines[0].startswith(str(package))
    assert "built for other op signatures" in lines[1] and "pip install --no-build-isolation -e ." in lines[1]
    assert "'cpp'" not in lines[2] and "'torch'" in lines[2] and lines[2].endswith(" True")


# --- loading ---------------------------------------------------------------------------------


def test_a_missing_extension_is_reported(monkeypatch):
    monkeypatch.setattr(cpp_backend, "EXTENSION", "hadw_kernels._not_built")
    assert "is not built" in cpp_backend._load_extension()


@needs_extension
def test_extension_loads_before_the_op_schemas():
    """Importing the kernels before ops/schemas.py defines the schemas works too: the
    dispatcher keeps the kernels and checks them against the schemas when they arrive."""
    code = (
        "import torch\n"
        "import hadw_kernels._cpu_kernels\n"
        "from hadw_kernels import ops\n"
        "h, w = torch.randn(3, 4), torch.randn(10, 4)\n"
        "logp = torch.ops.hadw_cpp.linear_logprob_forward(h, w, None, torch.tensor([1, 2, 3]), 1.0, -100, False)[0]\n"
        "print(torch.isfinite(logp).all().item())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


# --- setup.py's build modes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory):
    """What setup.py needs, copied: a failing build must not touch this checkout."""
    tree = tmp_path_factory.mktemp("source")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    shutil.copytree(ROOT / "hadw_kernels", tree / "hadw_kernels",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tree


def _build(tree: Path, mode: str, compiler: str):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tree), "HADW_BUILD_CPP": mode, "CXX": compiler}
    shutil.rmtree(tree / "build", ignore_errors=True)
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)


def _built(tree: Path) -> bool:
    return any((tree / "hadw_kernels").glob("_cpu_kernels*.so"))


def test_build_mode_0_skips_the_extension(source_tree):
    result = _build(source_tree, "0", "c++")
    assert result.returncode == 0, result.stderr
    assert not _built(source_tree)


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_no_compiler(source_tree, mode):
    result = _build(source_tree, mode, "/nonexistent/c++")
    assert not _built(source_tree)
    if mode == "auto":
        assert result.returncode == 0, result.stderr
        assert "NOT built" in result.stderr and "no C++ compiler" in result.stderr
    else:
        assert result.returncode != 0
        assert "HADW_BUILD_CPP=1" in result.stderr and "no C++ compiler" in result.stderr


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_failing_compiler(source_tree, mode):
    """A compiler that exists but fails (here `false`): a warning under auto, an error
    under 1. The constants header is written before compiling either way."""
    result = _build(source_tree, mode, "false")
    assert not _built(source_tree)
    header = source_tree / "build" / "generated" / cpp_constants.HEADER_NAME
    assert header.read_text() == cpp_constants.header(cpp_constants.installed)
    if mode == "auto":
        assert result.returncode == 0, result.stderr
        assert "FAILED" in result.stderr
    else:
        assert result.returncode != 0


def _available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (0 where there is none: the test is then skipped)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# An LM head of more than 2^31 elements in bf16 (4.4 GB): V x H = 2^20 x 2112.
_BIG_VOCAB, _BIG_HIDDEN = 1 << 20, 2112
_BIG_HEAD_BYTES = _BIG_VOCAB * _BIG_HIDDEN * 2


@pytest.mark.slow
@needs_extension
@pytest.mark.skipif(
    _available_memory_bytes() < 2 * _BIG_HEAD_BYTES,
    reason=f"needs {2 * _BIG_HEAD_BYTES / 2**30:.1f} GiB of available memory (a 4.1 GiB LM head)",
)
def test_offsets_beyond_two_to_the_31_elements():
    """Every offset into a tensor is 64-bit: the head's rows beyond element 2^31 (the last
    one's offset is (V - 1) H > 2^31) give the log-prob and entropy of a reference that
    forms the logits in chunks. An int product would wrap and read another row (or fault)."""
    assert _BIG_VOCAB * _BIG_HIDDEN > 2**31
    generator = torch.Generator().manual_seed(0)
    weight = torch.empty(_BIG_VOCAB, _BIG_HIDDEN, dtype=torch.bfloat16)
    for chunk in weight.split(1 << 16):
        chunk.normal_(generator=generator).mul_(_BIG_HIDDEN**-0.5)
    hidden = torch.randn(1, 4, _BIG_HIDDEN, generator=generator).to(torch.bfloat16)
    # The last row, one just past element 2^31, and one well before it.
    past = 2**31 // _BIG_HIDDEN + 1
    labels = torch.tensor([[_BIG_VOCAB - 1, past, 5, IGNORE]])
    assert past * _BIG_HIDDEN > 2**31
    logprobs, entropy = cpp_backend.BACKEND.token_logprobs(
        hidden[0], weight, labels[0], lm_head_bias=None, temperature=1.0, ignore_index=IGNORE, with_entropy=True
    )
    rows = hidden[0, :3].double()
    logits = torch.cat([rows @ chunk.double().T for chunk in weight.split(1 << 15)], dim=1)
    log_probs = torch.log_softmax(logits, dim=1)
    expected_logprobs = log_probs.gather(1, labels[0, :3, None]).squeeze(1)
    expected_entropy = -(log_probs.exp() * log_probs).sum(dim=1)
    torch.testing.assert_close(logprobs[:3].double(), expected_logprobs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy[:3].double(), expected_entropy, rtol=1e-4, atol=1e-4)
    assert logprobs[3] == 0 and entropy[3] == 0
