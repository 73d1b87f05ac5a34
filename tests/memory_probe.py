"""Peak memory of one loss forward+backward, in a fresh process.

    python memory_probe.py {eager|fused} N H V   ->   {"peak_bytes": ...} on stdout

The peak is the process's own high-water mark (VmHWM, reset once the inputs exist) minus
its resident set then, so imports and inputs do not count. Not ru_maxrss: exec folds the
parent's resident set into it, so a large pytest parent would hide the peak.
"""

import json
import sys

import torch

from hadw_kernels import fused_linear_hadw_grpo_loss
from hadw_kernels.batch.inputs import SurrogateBatch
from hadw_kernels.batch.token_layout import TokenLayout
from hadw_kernels.config.loss_config import LossConfig
from hadw_kernels.reference.linear_logprob import token_logprobs_reference
from hadw_kernels.reference.surrogate import surrogate_loss


def _status_bytes(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main():
    path, tokens, hidden, vocab = sys.argv[1], *map(int, sys.argv[2:5])
    torch.set_num_threads(2)
    group, width = 8, 256
    batch = tokens // width
    h = torch.randn(batch, width, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (batch, width))
    old = torch.full((batch, width), -10.0)
    rewards = torch.randint(0, 2, (batch,)).float()
    mask = torch.ones(batch, width, dtype=torch.bool)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := current resident set
    baseline = _status_bytes("VmRSS")
    if path == "eager":
        logp, _ = token_logprobs_reference(h.view(-1, hidden), w, labels.view(-1))
        layout = TokenLayout.padded(batch, width, mask.device)
        loss, _ = surrogate_loss(SurrogateBatch(layout, LossConfig.build("grpo", group), logp, old.view(-1),
                                                mask.view(-1), rewards=rewards, anchor=0.5))
    else:
        loss = fused_linear_hadw_grpo_loss(h, w, labels, old, rewards, mask, group_size=group, anchor=0.5, backend="torch")
    loss.backward()
    peak = _status_bytes("VmHWM")
    print(json.dumps({"path": path, "peak_bytes": peak - baseline}))


if __name__ == "__main__":
    main()
