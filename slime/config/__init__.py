"""The configuration of a run: every flag of ``train.py`` (``flags``), what upstream flags do here
(``registries``), the pre-Ray checks (``checks``, run in order by ``validate``), ``--help`` (``help``),
``parse_args`` (``parse``), the launch checks (``launch``), the engine choice (``engine``), the parallel layout
(``layout``), the run's derived configuration (``run_config``: ``args.run_config``, with its sub-configs ``loss``,
``process_groups``, ``health`` and ``weight_sync``), its facts after parsing (``run_state``) and arguments without a
command line (``defaults``).

``slime.utils.arguments`` re-exports the names upstream slime and its plug-ins import (``parse_args`` among them);
this package's own namespace holds only what the rooms below the checks read: the layout and the defaults.
"""

from __future__ import annotations

from slime.config.defaults import defaults_namespace
from slime.config.layout import LAYOUT_FLAGS, ParallelLayout, build_parallel_layout

__all__ = ["LAYOUT_FLAGS", "ParallelLayout", "build_parallel_layout", "defaults_namespace"]
