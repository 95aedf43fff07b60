"""The discrete-event model of a swarm: thousands of peers, the node's own rules, in seconds."""
