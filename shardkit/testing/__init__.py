"""Test helpers: the conformance suite every backend must pass, and one reset of process-global state."""

from .conformance import (CHECK_NAMES, WORLD_SIZES, CheckFailed, ConformanceCache,
                          ConformanceReport, SkipCheck, WorldResult, conformance_cases,
                          run_conformance, run_world)
from .reset import reset_state

__all__ = ["CHECK_NAMES", "WORLD_SIZES", "CheckFailed", "ConformanceCache", "ConformanceReport",
           "SkipCheck", "WorldResult", "conformance_cases", "reset_state", "run_conformance", "run_world"]
