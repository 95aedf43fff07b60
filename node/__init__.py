"""swarmgrad node daemon: config, identity, discovery, averaging, training, state, metrics, CLI."""
