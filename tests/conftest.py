"""Fixtures shared by every test package (helpers live in prague_testing.py)."""

from prague_testing import allreduce_run, mnist_dir  # noqa: F401  (re-exported fixtures)
