"""The "cpp" backend: C++ CPU kernels (csrc/) behind the hadw:: ops.

Importing the compiled module ``hadw_kernels._cpu_kernels`` registers its kernels for
the CPU dispatch key of the ``hadw_cpp::`` ops (same schemas as ``hadw::``, without the
routing argument); this module makes them the "cpp" kernels of the ``hadw::`` ops. The
module is built by the package install when a C++ compiler and torch are there
(setup.py); otherwise the backend says why it cannot serve, and "auto" takes "torch".
A module compiled from other tables (``cpp_constants.SOURCES``: its metric order or
option codes) is refused the same way: it would index the metrics wrongly; and so is one declared against
other op signatures (an editable install after a pull that changed an op), before it is
imported: registering its kernels against the running schemas would abort the process.
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import torch

from .. import ops
from ..ops.signatures import SIGNATURES
from ..tables.linear_blocks import block_rows_for
from ..tables.precision import accumulate_dtype
from .cpp_constants import fingerprint, installed
from .cpp_declarations import SCHEMA_MARK, schema_digest
from .kernel_backend import KernelBackend

NAME = "cpp"
EXTENSION = "hadw_kernels._cpu_kernels"


REBUILD = "rebuild it: pip install --no-build-isolation -e . (docs/architecture.md, 'C++: building')"


def _schemas_built_for(path: str) -> str | None:
    """The op signatures' digest compiled into the module at ``path``, read from its bytes
    (None: a module older than the digest)."""
    with open(path, "rb") as module_file:
        data = module_file.read()
    at = data.find(SCHEMA_MARK.encode())
    return None if at < 0 else data[at + len(SCHEMA_MARK):at + len(SCHEMA_MARK) + 64].decode("ascii", "replace")


def _load_extension() -> str | None:
    """Imports the kernels; returns why they cannot be used, or None."""
    spec = importlib.util.find_spec(EXTENSION)
    if spec is not None and spec.origin is not None:
        built_for = _schemas_built_for(spec.origin)
        if built_for != schema_digest(SIGNATURES):
            return (f"the C++ extension {EXTENSION} ({spec.origin}) was built for other op signatures than "
                    f"hadw_kernels/ops/signatures.py's{'' if built_for else ' (before they were recorded in it)'}: "
                    f"{REBUILD}")
    try:
        module = importlib.import_module(EXTENSION)
    except ModuleNotFoundError as error:
        if error.name != EXTENSION:
            raise
        return (
            f"the C++ extension {EXTENSION} is not built (the install found no C++ compiler or no "
            "torch at build time, or compiling failed: see its log, and docs/architecture.md, 'C++: building')"
        )
    except ImportError as error:
        return (
            f"the C++ extension {EXTENSION} does not load ({error}); it was probably built against "
            f"another torch than {torch.__version__}: reinstall the package"
        )
    built_with = json.loads(getattr(module, "CONFIG", "null"))
    if built_with != fingerprint(installed):
        return (
            f"the C++ extension {EXTENSION} was built from other hadw_kernels tables (metrics, aggregation modes, "
            f"objectives, KL estimators) than the ones running (metric order, option codes or clamps differ): "
            f"{REBUILD}"
        )
    return None


def _with_default_blocks(kernel):
    """The C++ linear surrogate, its default blocks (``block_rows`` 0) resolved here by
    ``linear_blocks.block_rows_for`` on the CPU, the one formula every backend uses, with the
    kernel's buffer in its compute type: over the N rows it is given (every row: the loss
    leaves finding the active ones to it), whose rows that count are known to the kernel
    only (reading their count here would be a host read of every call,
    docs/architecture.md, "Host synchronisation"). The kernel then cuts its active rows
    into blocks of at most that many."""
    names = [name for name in ops.argument_names("linear_surrogate_forward") if name != "backend"]
    block_rows_at, hidden_at, weight_at = (names.index(name) for name in ("block_rows", "hidden", "weight"))

    def linear_surrogate_forward(*arguments):
        if arguments[block_rows_at] == 0:
            hidden, weight = arguments[hidden_at], arguments[weight_at]
            buffer_element = accumulate_dtype(hidden.dtype).itemsize
            arguments = list(arguments)
            arguments[block_rows_at] = block_rows_for(hidden.shape[0], weight.shape[0], buffer_element, "cpu")
        return kernel(*arguments)

    return linear_surrogate_forward


def _has_cpu_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{ops.KERNEL_LIBRARY}::{op}", "CPU")


ops.set_unavailable_reason(NAME, "cuda", "its kernels are CPU only (csrc/); use 'triton' or 'auto' for CUDA tensors")
_UNAVAILABLE = _load_extension()
if _UNAVAILABLE is not None:
    ops.set_unavailable_reason(NAME, "cpu", _UNAVAILABLE)
else:
    for _op in ops.OPS:
        if _has_cpu_kernel(_op):
            _kernel = getattr(torch.ops.hadw_cpp, _op)
            if _op == "linear_surrogate_forward":
                _kernel = _with_default_blocks(_kernel)
            ops.register_kernel(_op, NAME, "cpu", _kernel)

# The kernels find the rows whose label counts themselves (csrc/linear_logprob.cpp), on the
# CPU, where that costs no synchronisation: the loss gives them every row.
BACKEND = KernelBackend(NAME, compacts_rows=True)
