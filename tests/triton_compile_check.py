"""Compiles every Triton kernel launch of representative calls to cubins for A100
(sm_80) and H100 (sm_90), without a GPU and without launching: the interpreter accepts
code the compiler rejects (globals that are not constexpr, for one). Run by
tests/test_triton_specific.py in a child process without TRITON_INTERPRET."""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

from hadw_kernels.config.loss_config import KL_ESTIMATORS, LossConfig
from hadw_kernels.objectives.table import OBJECTIVE_NAMES, OBJECTIVES
from hadw_kernels.tables.aggregations import AGG_MODES
from hadw_kernels.tables.estimators import ESTIMATOR_NAMES, ESTIMATORS
from hadw_kernels.triton import advantage, linear_logprob, scale, surrogate

launches = []


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names  # launch.BoundKernel binds by name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


scale.SMALLEST_FOR_KERNEL = 0  # the kernel, not mul_, on these small tensors
for module in (surrogate, advantage, linear_logprob, scale):
    for name, value in list(vars(module).items()):
        if isinstance(value, JITFunction) and name.endswith("_kernel"):
            setattr(module, name, Recorder(value))

batch, width = 8, 64
mask = torch.ones(batch * width, dtype=torch.bool)
cu_seqlens = torch.arange(batch + 1) * width
# Every objective in every ratio form it takes, each with other options (advantages from
# rewards by each estimator, James-Stein's with and without the batch's totals, the
# caller's per token or per response, importance weights, a KL estimator, an aggregation
# mode, the entropy, delta and dual clip) turning over along the list.
FORMS = [(objective, level) for objective in OBJECTIVE_NAMES for level in OBJECTIVES[objective].ratio_levels]
CLIP_OPTIONS = [dict(delta=1.5, dual_clip=3.0), dict(dual_clip=3.0), dict()]
REQUIRED_OPTIONS = {"dro": dict(dro_beta=0.1)}  # an option without a default
for dtype in (torch.bfloat16, torch.float32):
    values = lambda dtype=dtype: torch.zeros(batch * width, dtype=dtype)  # noqa: E731
    for index, (objective, level) in enumerate(FORMS):
        source = ("rewards", "token", "response")[index % 3]
        from_rewards = source == "rewards"
        estimator = ESTIMATORS[ESTIMATOR_NAMES[(index // 3) % len(ESTIMATOR_NAMES)] if from_rewards else "grpo"]
        options = CLIP_OPTIONS[index % 3] if objective == "clip" else REQUIRED_OPTIONS.get(objective, {})
        config = LossConfig.build(
            "grpo", 4 if from_rewards else None, objective=objective, ratio_level=level, beta=0.1,
            kl_estimator=KL_ESTIMATORS[index % len(KL_ESTIMATORS)], loss_agg_mode=AGG_MODES[index % len(AGG_MODES)],
            max_response_length=width, entropy_coef=0.01, advantage_estimator=estimator.name, **options)
        surrogate.surrogate_forward(
            logprobs=values(), old_logprobs=values(), response_mask=mask, cu_seqlens=cu_seqlens,
            rewards=torch.zeros(batch) if from_rewards else None,
            advantages=torch.zeros(batch * width) if source == "token" else None,
            response_advantages=torch.zeros(batch) if source == "response" else None,
            anchor=torch.tensor(0.5) if from_rewards else None, ref_logprobs=values(),
            importance_weights=torch.ones(batch * width) if index % 2 == 0 else None,
            entropy=values() if index % 4 < 2 else None,
            selected=mask if OBJECTIVES[objective].selects_tokens else None,
            batch_totals=torch.ones(6, dtype=torch.float64) if estimator.scope == "batch" and index // 12 % 2 else None,
            prior=torch.ones(batch, 2) if estimator.scope == "history" else None, **config.kernel_options())
    hidden = torch.zeros(batch * width, 32, dtype=dtype)
    weight = torch.zeros(100, 32, dtype=dtype)
    bias = torch.zeros(100, dtype=dtype)
    labels = torch.zeros(batch * width, dtype=torch.long)
    row = torch.zeros(batch * width)
    linear_logprob.linear_logprob_forward(hidden, weight, bias, labels, 0.7, -100, True)
    linear_logprob.linear_logprob_backward(row, row, hidden, weight, bias, labels, row, row, 0.7, -100)
    token_forms = [(objective, options) for objective in OBJECTIVE_NAMES
                   if "token" in OBJECTIVES[objective].ratio_levels
                   for options in (CLIP_OPTIONS if objective == "clip" else [REQUIRED_OPTIONS.get(objective, {})])]
    for index, (objective, options) in enumerate(token_forms):
        config = LossConfig.build("grpo", objective=objective, beta=0.1 * (index % 2),
                                  kl_estimator=KL_ESTIMATORS[index % len(KL_ESTIMATORS)], entropy_coef=0.01, **options)
        on_policy, weighted = index % 3 == 0, index % 2 == 0
        linear_logprob.linear_surrogate_forward(
            hidden=hidden, weight=weight, bias=bias if weighted else None, labels=labels,
            old_logprobs=None if on_policy else row, advantages=row, agg_weights=row, ref_logprobs=row,
            importance_weights=row if weighted else None, temperature=0.7, ignore_index=-100,
            **config.token_options(), with_entropy=not on_policy, block_rows=16 * (index % 2))
    scale.scale_in_place_(weight, torch.ones(()))
scale.scale_in_place_(torch.zeros(3, dtype=torch.float64), torch.ones((), dtype=torch.float64))

compiled = set()
for kernel, args, kwargs in launches:
    options = {"num_warps": kwargs.pop("num_warps")}
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = param.annotation_type or mangle_type(value)
    key = (kernel.__name__, tuple(signature.values()), tuple(map(str, constexprs.items())))
    if key in compiled:
        continue
    compiled.add(key)
    for capability in sys.argv[1:] or ("80", "90"):
        triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", int(capability), 32),
                       options=options)
print(sorted({name for name, *_ in compiled}))
print(len(compiled), "variants compiled")
