"""Test helpers for backend authors: the conformance suite every backend must pass."""

from .conformance import (CHECK_NAMES, WORLD_SIZES, CheckFailed, ConformanceCache,
                          ConformanceReport, SkipCheck, WorldResult, conformance_cases,
                          run_conformance, run_world)

__all__ = ["CHECK_NAMES", "WORLD_SIZES", "CheckFailed", "ConformanceCache", "ConformanceReport",
           "SkipCheck", "WorldResult", "conformance_cases", "run_conformance", "run_world"]
