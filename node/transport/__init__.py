"""gRPC transport: the node's one server for every service, channels to peers, upload pacing."""
