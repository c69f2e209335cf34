"""Generated protobuf/gRPC stubs of protos/ (`make protos`), and the public Python client.

The package is named after the proto packages (`radixserve.v1`, `radixserve.internal.v1`)
so generated imports resolve; it imports no services code, so every service can depend on
it without a cycle. `radixserve.client` (docs/client.md) is the users' client: it imports
only the public stubs (`radixserve.v1`), grpcio and pydantic, never `services`.
"""
