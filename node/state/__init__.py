"""State: what a node publishes and serves, downloads when behind, and checkpoints."""
