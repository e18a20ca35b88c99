"""Generated gRPC stubs for the pdserve.v1 API; regenerate with ``python -m router.api.generate_stubs``."""
