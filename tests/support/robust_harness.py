"""The rank harness's :class:`Ranks` style, under the name the robustness tests import.

Everything lives in tests/support/harness.py (one harness for both call styles); this module
only re-exports what tests/test_async.py and tests/test_shm_plane.py import from here.
"""

from __future__ import annotations

from .harness import RankCtx, Ranks, error_info, record

__all__ = ["RankCtx", "Ranks", "error_info", "record"]
