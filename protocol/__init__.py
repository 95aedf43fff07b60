"""Wire protocol: versioned .proto files, generated stubs, thin grpc.aio adapters."""

#: The protocol peers speak (part of every run spec's hash): 2 signs every request that acts for
#: a peer and seals every DHT value; 3 adds a pipeline stage replica's fields to peer records
#: (which DHT nodes check field by field); 4 makes open runs' check reports independent of the
#: result, seeded by the reveals that came, with forwarded accounts; 5 adds the peers a node
#: avoids to readiness records (which DHT nodes check field by field). Peers of different
#: versions never meet.
PROTOCOL_VERSION = 5
