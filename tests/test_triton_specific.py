"""What only the Triton kernels have: compilation for real GPUs, no host
synchronisation in the surrogate, launch geometry for any batch, int64 offsets, and the
device helpers' tie rules. The numbers are in the conformance suite."""

import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_objectives import OPTIONS  # noqa: E402
from test_objectives import _config as objective_config
from test_objectives import _points as objective_points

from hadw_kernels import fused_hadw_grpo_loss  # noqa: E402
from hadw_kernels.config.loss_config import LossConfig  # noqa: E402
from hadw_kernels.objectives import formulas as objectives  # noqa: E402
from hadw_kernels.objectives.table import OBJECTIVE_NAMES, OBJECTIVES, RATIO_LEVELS  # noqa: E402
from hadw_kernels.triton import scale as scale_module  # noqa: E402
from hadw_kernels.triton import surrogate as triton_surrogate  # noqa: E402
from hadw_kernels.triton import token_math as triton_token_math  # noqa: E402
from hadw_kernels.triton.scale import scale_in_place_  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs Triton's interpreter or a GPU")
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# Every objective with its options away from their defaults (tests/test_objectives.py).
OBJECTIVE_CASES = [(name, options) for name in OBJECTIVE_NAMES for options in OPTIONS[name]]


def test_the_kernels_take_the_option_slots_of_the_table():
    """objectives.table.OPTION_SLOTS states how many option scalars the kernels take."""
    from hadw_kernels.objectives.table import OPTION_SLOTS
    from hadw_kernels.triton import linear_logprob as triton_linear

    for kernel in (triton_surrogate._surrogate_kernel, triton_linear._row_surrogate_kernel):
        assert [name for name in kernel.arg_names if name.startswith("option_")] == \
            [f"option_{slot}" for slot in range(OPTION_SLOTS)]
    assert set(triton_token_math.option_slots([1.0])) == {f"option_{slot}" for slot in range(OPTION_SLOTS)}


def _batch(batch=8, width=5):
    logprobs = -torch.rand(batch, width, device=DEVICE)
    rewards = torch.tensor([1.0, 0.0] * (batch // 2), device=DEVICE)
    return logprobs, logprobs + 0.1, rewards, torch.ones(batch, width, dtype=torch.bool, device=DEVICE)


@pytest.mark.slow
def test_kernels_compile_for_a100_and_h100(tmp_path):
    """The interpreter accepts code the compiler rejects (globals that are not
    constexpr, for one): every kernel variant of representative calls compiles to a cubin
    for sm_80 and sm_90, without a GPU."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, leave no cache behind
    # The child imports the package as this process does, installed or not.
    repo_root = str(Path(__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, environment.get("PYTHONPATH")]))
    script = Path(__file__).with_name("triton_compile_check.py")
    result = subprocess.run([sys.executable, str(script)], env=environment, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines()[0] == str(sorted([
        "_logit_gradient_kernel", "_row_stats_kernel", "_row_surrogate_kernel", "_scale_kernel", "_surrogate_kernel",
        "_totals_kernel"]))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])  # dapo: token-mean, whose grad_scale is an output too
def test_outputs_do_not_depend_on_recycled_memory(loss_type):
    """The surrogate's outputs are allocated without a fill: the kernel must write every
    element. Freed NaN blocks of the outputs' sizes come back from the allocator (CUDA's
    caching allocator; glibc's free lists under the interpreter)."""
    logprobs, old, rewards, mask = _batch(batch=8, width=37)
    entropy = torch.rand(8, 37, device=DEVICE)
    mask[1, 20:] = False
    mask[2] = False
    cu_seqlens = torch.arange(9, device=DEVICE) * 37

    options = LossConfig.build(loss_type, 4, lambda_scale=1.5, entropy_coef=0.01).kernel_options()

    def call():
        return triton_surrogate.surrogate_forward(
            logprobs=logprobs.view(-1), old_logprobs=old.view(-1), response_mask=mask.view(-1), cu_seqlens=cu_seqlens,
            rewards=rewards, advantages=None, response_advantages=None, anchor=None, ref_logprobs=None, importance_weights=None,
            entropy=entropy.view(-1), selected=None, batch_totals=None, prior=None, **options,
        )

    clean = call()
    for _ in range(3):
        poison = [torch.full_like(output, float("nan")) for output in clean for _ in range(4)]
        del poison
        for output, expected in zip(call(), clean):
            torch.testing.assert_close(output, expected, rtol=0, atol=0)


def test_no_host_synchronisation(monkeypatch):
    """No tensor value reaches Python in the surrogate: every way of reading one raises."""
    logprobs, old, rewards, mask = _batch()
    logprobs.requires_grad_()
    anchor = torch.tensor(0.3, device=DEVICE)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for method in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    loss = fused_hadw_grpo_loss(logprobs, old, rewards, mask, group_size=2, loss_type="dapo", anchor=anchor,
                                backend="triton", check_values=False)
    loss.backward()
    monkeypatch.undo()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


class _LaunchRecorder:
    def __init__(self, kernel):
        self.grids = []
        self.arg_names = kernel.arg_names  # launch.BoundKernel binds by name

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_rows_are_on_grid_axis_0(monkeypatch):
    """70,000 responses exceed CUDA's 65,535 limit on grid axes 1 and 2 (the interpreter
    has none and would take minutes): one program per response, all on axis 0."""
    recorder = _LaunchRecorder(triton_surrogate._surrogate_kernel)
    monkeypatch.setattr(triton_surrogate, "_surrogate_kernel", recorder)
    zeros = torch.zeros(70_000, 2, device=DEVICE)
    for loss_type in ("grpo", "gspo"):
        fused_hadw_grpo_loss(zeros, zeros, torch.zeros(70_000, device=DEVICE),
                             torch.ones(70_000, 2, dtype=torch.bool, device=DEVICE),
                             group_size=2, loss_type=loss_type, backend="triton", check_values=False)
    assert recorder.grids == [(70_000,), (70_000,)]


def test_token_offsets_beyond_int32():
    """Packed tokens 2^30 + 7 elements apart (a strided [N] view, which the loss takes
    without a copy): the last token lies past 2^31, where an int32 token * stride would
    wrap. Buffers are allocated lazily: only touched pages count."""
    if DEVICE != "cpu":
        pytest.skip("the lazily allocated 8 GiB buffer is a CPU trick")
    tokens, stride = 3, 2**30 + 7
    logprobs = -torch.rand(tokens)
    old = logprobs + 0.1 * torch.randn(tokens)
    mask = torch.tensor([True, False, True])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    values = torch.empty((tokens - 1) * stride + 2)
    flags = torch.empty((tokens - 1) * stride + 1, dtype=torch.bool)
    spread_logprobs = values.as_strided((tokens,), (stride,), 0)
    spread_old = values.as_strided((tokens,), (stride,), 1)
    spread_mask = flags.as_strided((tokens,), (stride,))
    spread_logprobs.copy_(logprobs)
    spread_old.copy_(old)
    spread_mask.copy_(mask)
    kwargs = dict(group_size=3, anchor=0.2, backend="triton", return_metrics=True,
                  cu_seqlens=torch.arange(tokens + 1))
    dense = logprobs.clone().requires_grad_()
    spread = spread_logprobs.requires_grad_()
    expected, expected_metrics = fused_hadw_grpo_loss(dense, old, rewards, mask, **kwargs)
    actual, actual_metrics = fused_hadw_grpo_loss(spread, spread_old, rewards, spread_mask, **kwargs)
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(spread.grad, dense.grad, rtol=0, atol=0)
    for name in expected_metrics:
        torch.testing.assert_close(actual_metrics[name], expected_metrics[name], rtol=0, atol=0)


@triton.jit
def _objective_kernel(
    ratio_ptr, advantage_ptr, logprob_ptr, old_logprob_ptr, weight_ptr, value_ptr, d_ratio_ptr, d_logprob_ptr, count,
    epsilon_low: tl.float64, epsilon_high: tl.float64,
    option_0: tl.float64, option_1: tl.float64, option_2: tl.float64, option_3: tl.float64,
    OBJECTIVE: tl.constexpr, BLOCK: tl.constexpr,
):
    index = tl.arange(0, BLOCK)
    inside = index < count
    ratio = tl.load(ratio_ptr + index, mask=inside, other=1.0)
    advantage = tl.load(advantage_ptr + index, mask=inside, other=0.0)
    logprob = tl.load(logprob_ptr + index, mask=inside, other=0.0)
    old_logprob = tl.load(old_logprob_ptr + index, mask=inside, other=0.0)
    weight = tl.load(weight_ptr + index, mask=inside, other=0.0)
    # 0-d tensors, as the kernels pass the options: the interpreter rounds a bare float
    # scalar in tl.where to float32.
    value, d_ratio, d_logprob = triton_token_math.objective_terms(
        ratio, advantage, logprob, old_logprob, weight, tl.full([], 1.0 - epsilon_low, tl.float64),
        tl.full([], 1.0 + epsilon_high, tl.float64), tl.full([], epsilon_low, tl.float64),
        tl.full([], epsilon_high, tl.float64),
        triton_token_math.objective_option_values(option_0, option_1, option_2, option_3, tl.float64), OBJECTIVE)
    tl.store(value_ptr + index, value, mask=inside)
    tl.store(d_ratio_ptr + index, d_ratio, mask=inside)
    tl.store(d_logprob_ptr + index, d_logprob, mask=inside)


def _objective_terms(config, ratio, advantage, logprob, old_logprob, weight):
    """objective_terms of ``config``'s objective at float64 points, on the device."""
    inputs = [t.to(DEVICE) for t in (ratio, advantage, logprob, old_logprob, weight)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(3)]
    options = config.token_options()
    _objective_kernel[(1,)](
        *inputs, *outputs, ratio.numel(), config.epsilon_low, config.epsilon_high,
        **triton_token_math.option_slots(options["objective_options"]), OBJECTIVE=options["objective"],
        BLOCK=triton.next_power_of_2(ratio.numel()),
    )
    return [output.cpu() for output in outputs]


@pytest.mark.parametrize("objective, options", OBJECTIVE_CASES, ids=str)
def test_objective_terms_are_objectives_py(objective, options):
    """The device transcription of every objective: objectives.py's value and derivatives
    (themselves autograd's, tests/test_objectives.py) at its random points and edges (the
    clip bounds, delta, the dual-clip bound, ties, A = 0), in float64."""
    config = objective_config(objective, options)
    points = objective_points(config)
    value, d_ratio, d_logprob = _objective_terms(config, *points)
    expected_ratio, expected_logprob = OBJECTIVES[objective].slope(*points, config)
    torch.testing.assert_close(value, OBJECTIVES[objective].value(*points, config), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_ratio, expected_ratio, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_logprob, expected_logprob, rtol=1e-12, atol=1e-12)


def test_dual_clip_tie_halves_the_slope():
    """At the exact dual-clip bound torch.minimum splits the gradient between the
    objective and the bound, so half the slope passes (as the reference and C++ do);
    above it none, below it all."""
    config = LossConfig.build("grpo", epsilon_low=0.2, epsilon_high=0.2, dual_clip=3.0)
    ratio = torch.tensor([3.0, 3.5, 2.5, 3.0], dtype=torch.float64)
    advantage = torch.tensor([-1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    zeros = torch.zeros(4, dtype=torch.float64)
    _, d_ratio, _ = _objective_terms(config, ratio, advantage, zeros, zeros, zeros)
    assert d_ratio.tolist() == [0.5, 0.0, 1.0, 0.0]  # the last one is clipped above 1.2


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_a_zero_advantage_forms_no_nan_in_the_clip(dual_clip):
    """A zero advantage (a degenerate group's) with the dual clip off forms no -inf * 0 in
    the unused bound: finite inputs give finite lanes throughout, which the interpreter's
    numpy would otherwise warn of on every call."""
    options = {} if dual_clip is None else {"dual_clip": dual_clip}
    config = LossConfig.build("grpo", epsilon_low=0.2, epsilon_high=0.2, **options)
    ratio = torch.tensor([0.5, 1.0, 1.5, 1.0], dtype=torch.float64)
    advantage = torch.tensor([0.0, 0.0, -1.0, 1.0], dtype=torch.float64)
    zeros = torch.zeros(4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        objective, d_ratio, _ = _objective_terms(config, ratio, advantage, zeros, zeros, zeros)
    assert torch.isfinite(objective).all() and torch.isfinite(d_ratio).all()


def test_the_gradient_route_splits_the_objectives_as_their_slopes_do():
    """The table's gradient route (config.Objective.gradient), which the kernels branch on:
    an objective through the ratio has no log-prob slope, the others no ratio slope."""
    for objective in OBJECTIVE_NAMES:
        config = objective_config(objective, OPTIONS[objective][0])
        d_ratio, d_logprob = OBJECTIVES[objective].slope(*objective_points(config), config)
        if OBJECTIVES[objective].gradient == "ratio_and_log_prob":
            assert torch.any(d_logprob != 0) and torch.any(d_ratio != 0), objective
        elif OBJECTIVES[objective].through_ratio:
            assert torch.all(d_logprob == 0) and torch.any(d_ratio != 0), objective
        else:
            assert torch.all(d_ratio == 0) and torch.any(d_logprob != 0), objective


@triton.jit
def _response_log_ratio_kernel(log_ratio_ptr, advantage_ptr, clipped_ptr, passes_ptr, epsilon_low: tl.float64,
                               epsilon_high: tl.float64, OBJECTIVE: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.arange(0, BLOCK)
    log_ratio = tl.load(log_ratio_ptr + index)
    advantage = tl.load(advantage_ptr + index)
    clipped, passes = triton_token_math.response_log_ratio(log_ratio, advantage, epsilon_low, epsilon_high, OBJECTIVE)
    tl.store(clipped_ptr + index, clipped)
    tl.store(passes_ptr + index, passes.to(tl.float64))


def test_gmpo_clip_and_where_it_passes_the_gradient():
    """GMPO's log-space clip on the device and where it passes its log-ratio's gradient:
    objectives.gmpo_log_ratio and its autograd derivative, at the bounds (ties) too."""
    config = LossConfig.build("gmpo", epsilon_low=0.2, epsilon_high=0.3)
    values = torch.tensor([-1.0, -0.2, -0.1, 0.0, 0.1, 0.3, 1.0, float("nan")], dtype=torch.float64)
    log_ratio = values.repeat(3)
    advantage = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64).repeat_interleave(values.numel())
    block = triton.next_power_of_2(log_ratio.numel())
    log_ratio = torch.cat([log_ratio, torch.zeros(block - log_ratio.numel(), dtype=torch.float64)])
    advantage = torch.cat([advantage, torch.zeros(block - advantage.numel(), dtype=torch.float64)])
    clipped, passes = (torch.empty(block, dtype=torch.float64, device=DEVICE) for _ in range(2))
    _response_log_ratio_kernel[(1,)](log_ratio.to(DEVICE), advantage.to(DEVICE), clipped, passes, 0.2, 0.3,
                                     OBJECTIVE=OBJECTIVE_NAMES.index("gmpo"), BLOCK=block)
    leaf = log_ratio.clone().requires_grad_()
    expected = objectives.gmpo_log_ratio(leaf, advantage, config)
    (gradient,) = torch.autograd.grad(expected.sum(), leaf)
    torch.testing.assert_close(clipped.cpu(), expected.detach(), rtol=0, atol=0, equal_nan=True)
    finite = ~torch.isnan(log_ratio)
    assert torch.equal(passes.cpu()[finite], gradient[finite])


@triton.jit
def _vespo_kernel(summed_ptr, phi_ptr, k: tl.float64, lam: tl.float64, BLOCK: tl.constexpr):
    index = tl.arange(0, BLOCK)
    tl.store(phi_ptr + index, triton_token_math.vespo_weight(tl.load(summed_ptr + index), k, lam))


@pytest.mark.parametrize("k, lam, overflows", [(1.5, 2.5, False), (2.5, 1.5, False), (60.0, 1e-30, True)])
def test_vespo_weight_is_objectives_py(k, lam, overflows):
    """VESPO's weight on the device, its log-weight clamped below and above, and 0 where
    it is NaN or overflows (the last (k, lam): w^k past float64's range from w = e^15)."""
    config = LossConfig.build("vespo", vespo_k_pos=k, vespo_lambda_pos=lam)
    summed = torch.tensor([-40.0, -18.0, -2.0, 0.0, 0.5, 15.0, 25.0, float("nan")], dtype=torch.float64)
    phi = torch.empty_like(summed, device=DEVICE)
    _vespo_kernel[(1,)](summed.to(DEVICE), phi, k, lam, BLOCK=summed.numel())
    expected = objectives.vespo_weight(summed, torch.ones_like(summed), config)
    torch.testing.assert_close(phi.cpu(), expected, rtol=1e-12, atol=0)
    assert phi[-1].item() == 0.0
    if overflows:
        assert phi[-3:].tolist() == [0.0, 0.0, 0.0]


def test_launchers_refuse_a_ratio_form_the_objective_lacks():
    """Below LossConfig's checks, the launchers name what they cannot serve rather than
    fail to compile: VESPO in the token form, and GMPO and VESPO (whole responses) on the
    gradients-in-forward linear path."""
    from hadw_kernels.triton.linear_logprob import linear_surrogate_forward

    logprobs, old, _, mask = _batch(batch=2, width=3)
    kernel_options = LossConfig.build("vespo").kernel_options()
    kernel_options["ratio_level"] = RATIO_LEVELS.index("token")
    with pytest.raises(ValueError, match="objective 'vespo' takes ratio_level in"):
        triton_surrogate.surrogate_forward(
            logprobs=logprobs.view(-1), old_logprobs=old.view(-1), response_mask=mask.view(-1),
            cu_seqlens=torch.arange(3, device=DEVICE) * 3, rewards=None, advantages=torch.ones(6, device=DEVICE),
            response_advantages=None, anchor=None, ref_logprobs=None, importance_weights=None, entropy=None, selected=None, batch_totals=None, prior=None, **kernel_options)
    rows = torch.zeros(4, device=DEVICE)
    for loss_type in ("gmpo", "vespo"):
        with pytest.raises(ValueError, match=f"objective '{loss_type}' reads whole responses"):
            linear_surrogate_forward(
                hidden=torch.zeros(4, 8, device=DEVICE), weight=torch.zeros(5, 8, device=DEVICE), bias=None,
                labels=torch.zeros(4, dtype=torch.long, device=DEVICE), old_logprobs=None, advantages=rows,
                agg_weights=rows, ref_logprobs=None, importance_weights=None, temperature=1.0, ignore_index=-100,
                **LossConfig.build(loss_type).token_options(), with_entropy=False, block_rows=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_in_place_scaling_is_mul_(dtype, monkeypatch):
    """The backward's scaling of the gradients formed in the forward: bit for bit the
    product in fp32 (fp64 for fp64) with the upstream scalar unrounded, rounded once, as
    ``mul_`` by a CPU scalar does (by a CUDA one, ``mul_`` rounds the scalar to a 16-bit
    tensor's dtype first), over several programs and a ragged end; nothing changes (NaN
    and inf included) when the scalar is 1, and a NaN scalar reaches every value."""
    monkeypatch.setattr(scale_module, "SMALLEST_FOR_KERNEL", 0)  # the kernel, not mul_, at this size
    values = torch.randn(3 * 4096 + 5, device=DEVICE).to(dtype)
    values[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    compute = torch.promote_types(dtype, torch.float32)
    for scale in (0.37, -3.0, 1.0, 0.0, float("inf")):
        scalar = torch.tensor(scale, dtype=compute, device=DEVICE)
        scaled = scale_in_place_(values.clone(), scalar)
        expected = (values.to(compute) * scalar).to(dtype)
        torch.testing.assert_close(scaled, expected, rtol=0, atol=0, equal_nan=True)
        if not expected.view(-1)[2].isnan():  # -0.0 * inf: a NaN's sign is the instruction set's to choose
            assert torch.equal(scaled.view(-1)[2:3].signbit(), expected.view(-1)[2:3].signbit())
    nan = torch.tensor(float("nan"), device=DEVICE)
    assert scale_in_place_(values.clone(), nan).isnan().all()
    strided = values.clone()[::2]
    torch.testing.assert_close(scale_in_place_(strided, scalar), values[::2].clone().mul_(scalar), rtol=0, atol=0,
                               equal_nan=True)


def _cuda_synchronisations(call) -> list[str]:
    """The warnings of CUDA's synchronisation debug mode while ``call()`` runs: one for
    each time it made the host wait for the GPU."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if str(w.message).startswith("called a synchronizing")]


def _cuda_linear_batch(padded_from: int = 16):
    """hidden [2, 16, 32] and a head of V = 64 on CUDA (leaves), labels, rewards, and a
    mask whose positions from ``padded_from`` on are padding."""
    hidden = torch.randn(2, 16, 32, device="cuda", requires_grad=True)
    weight = torch.randn(64, 32, device="cuda", requires_grad=True)
    labels = torch.randint(0, 64, (2, 16), device="cuda")
    mask = torch.ones(2, 16, dtype=torch.bool, device="cuda")
    mask[:, padded_from:] = False
    return hidden, weight, labels, torch.tensor([0.0, 1.0], device="cuda"), mask


@pytest.mark.skipif(not torch.cuda.is_available() or DEVICE != "cuda", reason="CUDA's synchronisation debug mode")
def test_linear_loss_never_synchronises_on_cuda():
    """The fused linear loss with values unchecked never waits for the GPU: its blocks are
    planned over every row, not the count of active ones. A wait, after the model's forward
    was queued, would leave the GPU idle while Python runs (a Python anchor once made a
    blocking copy; the count of active rows was one on every call)."""
    from hadw_kernels import fused_linear_hadw_grpo_loss

    hidden, weight, labels, rewards, mask = _cuda_linear_batch()
    for anchor in (0.5, torch.tensor(0.5, device="cuda")):
        def call(anchor=anchor):
            fused_linear_hadw_grpo_loss(hidden, weight, labels, None, rewards, mask, group_size=2, anchor=anchor,
                                        backend="triton", check_values=False).backward()

        assert _cuda_synchronisations(call) == []


@pytest.mark.skipif(not torch.cuda.is_available() or DEVICE != "cuda", reason="CUDA's synchronisation debug mode")
def test_checked_linear_loss_synchronises_once_on_cuda():
    """The default call (value checks on) waits for the GPU once: the checks' read, which
    also counts the active rows; finding them (nonzero_static) and sweeping them alone
    waits for nothing more."""
    from hadw_kernels import fused_linear_hadw_grpo_loss

    hidden, weight, labels, rewards, mask = _cuda_linear_batch(padded_from=10)
    for path in ("gradients_in_forward", "recompute"):
        def call(path=path):
            fused_linear_hadw_grpo_loss(hidden, weight, labels, None, rewards, mask, group_size=2, anchor=0.5,
                                        backend="triton", linear_path=path).backward()

        syncs = _cuda_synchronisations(call)
        assert len(syncs) == 1, (path, syncs)
        assert torch.all(hidden.grad[:, 10:] == 0)
        hidden.grad = weight.grad = None


class _StandInCompiled:
    """What Triton's launch returns on a GPU: a compiled kernel with its launcher."""

    function = "cu-function"
    packed_metadata = "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *arguments):
        self.launches.append(arguments)

    def launch_metadata(self, grid, stream, *values):
        return None


class _StandInKernel:
    """A JIT function's face: its parameters' names and ``kernel[grid](**arguments)``."""

    __name__ = "_stand_in_kernel"
    arg_names = ["x_ptr", "count", "scale", "BLOCK", "y_ptr"]

    def __init__(self):
        self.compiles = []

    def __getitem__(self, grid):
        def launch(**arguments):
            compiled = _StandInCompiled()
            self.compiles.append((grid, arguments, compiled))
            return compiled

        return launch


def test_a_bound_kernel_launches_its_compiled_kernel_directly(monkeypatch):
    """On a GPU (stood in for here) a BoundKernel goes through Triton's launch once per
    specialisation of its per-call arguments (Triton's own: dtype and 16-byte alignment of
    a tensor, an integer's divisibility by 16 and whether it is 1; floats not at all), then
    calls that compiled kernel's launcher itself with every parameter in the kernel's
    order, the constants in their places, the grid on three axes and the current stream."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from hadw_kernels.triton import launch

    monkeypatch.setattr(launch, "_direct_launches", lambda: True)
    monkeypatch.setattr(launch, "_specialiser", lambda: functools.partial(native_specialize_impl, BaseBackend))
    monkeypatch.setattr(launch, "_current_stream", lambda device: f"stream-{device}")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = _StandInKernel()
    bound = launch.BoundKernel(kernel, BLOCK=128, num_warps=4)
    x, y = torch.zeros(64), torch.zeros(64)
    bound((3,), x, 32, 0.5, y)
    assert len(kernel.compiles) == 1
    grid, arguments, compiled = kernel.compiles[0]
    assert grid == (3,) and arguments == dict(x_ptr=x, count=32, scale=0.5, y_ptr=y, BLOCK=128, num_warps=4)
    assert compiled.launches == []  # Triton's launch ran it
    bound((5, 2), x, 48, 0.25, y)  # same specialisation: another count divisible by 16, another float
    assert len(kernel.compiles) == 1
    (launched,) = compiled.launches
    assert launched[:9] == (5, 2, 1, "stream-0", "cu-function", "packed-metadata", None,
                            triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    assert launched[9:] == (x, 48, 0.25, 128, y)
    for other in ((x, 17, 0.5, y), (x, 1, 0.5, y), (x[1:], 32, 0.5, y), (x.double(), 32, 0.5, y)):
        bound((1,), *other)
    assert len(kernel.compiles) == 5  # each a specialisation of its own
    with pytest.raises(TypeError, match="expected arguments"):
        bound((1,), x, 32, 0.5)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("loss", ["surrogate", "linear"])
def test_a_call_is_captured_in_a_cuda_graph(loss, loss_type):
    """With values unchecked and a tensor anchor (a Python float would be captured as the
    value it had), a forward and backward of either loss is captured in one CUDA graph and
    replayed on new values into the same tensors: eager's loss and gradients
    (docs/architecture.md, "Taking the host out of the loop")."""
    from hadw_kernels import fused_linear_hadw_grpo_loss

    generator = torch.Generator(device="cuda").manual_seed(0)
    rewards = torch.tensor([1.0, 0.0] * 4, device="cuda")
    mask = torch.ones(8, 16, dtype=torch.bool, device="cuda")
    mask[::3, 10:] = False
    anchor = torch.tensor(0.4, device="cuda")
    if loss == "surrogate":
        leaves = [torch.zeros(8, 16, device="cuda", requires_grad=True)]
        others = [torch.zeros(8, 16, device="cuda")]

        def fill():
            with torch.no_grad():
                leaves[0].copy_(-torch.rand(8, 16, device="cuda", generator=generator))
                others[0].copy_(leaves[0] + 0.1 * torch.randn(8, 16, device="cuda", generator=generator))

        def call():
            return fused_hadw_grpo_loss(leaves[0], others[0], rewards, mask, group_size=2, anchor=anchor,
                                        loss_type=loss_type, backend="triton", check_values=False)
    else:
        leaves = [torch.zeros(8, 16, 32, device="cuda", requires_grad=True),
                  torch.zeros(64, 32, device="cuda", requires_grad=True)]
        others = [torch.zeros(8, 16, dtype=torch.long, device="cuda"), torch.zeros(8, 16, device="cuda")]

        def fill():
            with torch.no_grad():
                leaves[0].copy_(torch.randn(8, 16, 32, device="cuda", generator=generator))
                leaves[1].copy_(0.1 * torch.randn(64, 32, device="cuda", generator=generator))
                others[0].copy_(torch.randint(0, 64, (8, 16), device="cuda", generator=generator))
                others[1].copy_(-2 - torch.rand(8, 16, device="cuda", generator=generator))

        def call():
            return fused_linear_hadw_grpo_loss(leaves[0], leaves[1], others[0], others[1], rewards, mask,
                                               group_size=2, anchor=anchor, loss_type=loss_type, backend="triton",
                                               check_values=False)

    def step():
        for leaf in leaves:
            leaf.grad = None
        value = call()
        value.backward()
        return value

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture: compiles, caches, allocator pools
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    # The graph accumulates into the gradients the leaves hold when it is captured.
    grads = [torch.zeros_like(leaf) for leaf in leaves]
    for leaf, grad in zip(leaves, grads):
        leaf.grad = grad
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
        captured.backward()
    for _ in range(2):
        fill()
        for grad in grads:
            grad.zero_()
        graph.replay()
        replayed = [captured.detach().clone()] + [grad.clone() for grad in grads]
        expected = [step().detach()] + [leaf.grad for leaf in leaves]
        for got, want in zip(replayed, expected):
            torch.testing.assert_close(got, want)
