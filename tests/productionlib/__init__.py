"""Helpers of the production export tests (tests/test_production_*.py)."""
