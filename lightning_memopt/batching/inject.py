"""Deprecated location of the OOM injector: import it from :mod:`lightning_memopt.testing`.

Kept for one release so that code written against 0.1.0 still imports; it warns on import.
"""

import warnings

from lightning_memopt.testing.oom import InjectedOOM, OOMInjector

__all__ = ["InjectedOOM", "OOMInjector"]

warnings.warn(
    "lightning_memopt.batching.inject is deprecated and will be removed in the next release; "
    "import OOMInjector and InjectedOOM from lightning_memopt.testing instead",
    DeprecationWarning,
    stacklevel=2,
)
