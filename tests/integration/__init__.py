"""Integration tests: real gRPC servers, DHT nodes and node processes on loopback or in
network namespaces the tests create."""
