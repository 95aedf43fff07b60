"""Averaging: groups, matchmaking through the DHT, the butterfly all-reduce and its owners."""
