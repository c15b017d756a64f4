"""Generated protobuf and gRPC stubs of proto/tessera/v1 (the one home; `make proto` regenerates)."""
