"""Shared test helpers: spawning ranks (spawn.py), the test models and single-process reference
(models.py), tolerance checks that report their margin (margins.py), independent memory figures
(accounting.py)."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
