"""Reachability of the node's gRPC endpoint: dial-back, UPnP/NAT-PMP, relays, punching."""
