"""Generated from proto/pdserve/v1/*.proto by router.api.generate_stubs; do not edit the *_pb2* files."""
