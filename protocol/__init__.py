"""Wire protocol: versioned .proto files, generated stubs, thin grpc.aio adapters."""
