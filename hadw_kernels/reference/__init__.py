"""The pure-PyTorch references every fast path is tested against.

``surrogate`` is the clipped surrogate, aggregation, KL estimators and metrics with
autograd (also the "torch" backend's surrogate); ``linear_logprob`` forms the full
``[N, V]`` logits, as eager trainers do, and serves the tests only: nothing in the
package imports it.
"""
