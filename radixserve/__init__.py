"""Generated protobuf/gRPC stubs of protos/ (`make protos`), and nothing else.

The package is named after the proto packages (`radixserve.v1`, `radixserve.internal.v1`)
so generated imports resolve; it imports no other radixserve code, so every service can
depend on it without a cycle.
"""
