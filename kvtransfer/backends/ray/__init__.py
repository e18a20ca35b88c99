"""The Ray object-store backend: the fallback where NIXL is missing, and the benchmark baseline."""
