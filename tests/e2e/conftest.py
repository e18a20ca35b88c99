"""End-to-end tests use the shared fixtures of tests/conftest.py and helpers of tests/serving.py."""
