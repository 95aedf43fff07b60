"""Wire protocol: versioned .proto files, generated stubs, thin grpc.aio adapters."""

#: The protocol peers speak (part of every run spec's hash): 2 signs every request that acts for
#: a peer and seals every DHT value; peers of different versions never meet.
PROTOCOL_VERSION = 2
