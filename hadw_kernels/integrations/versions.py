"""The releases of TRL and verl the integrations support, checked when they are imported.

Both integrations depend on what their peer does not promise to keep: the TRL one
overrides ``GRPOTrainer``'s private hooks (``_calculate_rewards``,
``_generate_and_score_completions``, ``_compute_loss``) and imports ``_ForwardRedirection``
and ``maybe_gather_lm_head_ctx``; the verl one registers into ``core_algos``' registries,
reads ``global_batch_info`` and subclasses ``CheckpointCallback``. The ranges are what was
read and tested (docs/packaging.md, "Integrations"); pyproject.toml's ``trl`` and ``verl``
extras carry the same specifiers (tests/test_packaging.py checks that they agree).

- TRL ``>=1.15,<1.17``: 1.16.0 is tested; 1.15.0 has the same hooks and passes
  tests/test_integration_trl.py. 1.14 and earlier route ``compute_loss`` differently under
  ``use_liger_kernel``.
- verl ``>=0.9.1,<0.10``: 0.9.1 is tested. 0.9.0 and 0.8 have no
  ``verl.trainer.ppo.checkpoint_callback`` (and 0.8 no ``verl.plugins`` entry points).

The upper bounds are the next minor releases, which nobody has tested: a newer release
fails on import with the range named, rather than later with an AttributeError.
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED = {
    "trl": ">=1.15,<1.17",
    "verl": ">=0.9.1,<0.10",
}


def require_supported(package: str) -> str:
    """The installed version of ``package``; ImportError naming the supported range when
    it is outside it (or when the package is not installed)."""
    supported = SUPPORTED[package]
    extra = f'pip install "hadw-kernels[{package}]"'
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"hadw_kernels.integrations.{package} needs {package}{supported}, which is not "
                          f"installed: {extra}") from None
    if not SpecifierSet(supported).contains(Version(installed), prereleases=True):
        raise ImportError(
            f"hadw_kernels.integrations.{package} supports {package}{supported}, found {package} {installed}: "
            f"it overrides internals that change between releases. Install a supported release ({extra}, or "
            f'pip install "{package}{supported}")'
        )
    return installed
