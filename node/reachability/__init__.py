"""Reachability of the node's gRPC endpoint: dial-back, UPnP IGD, relays, punching."""
