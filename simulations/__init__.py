"""Local swarms: real node processes and a discrete-event model, reusing the node's code."""
