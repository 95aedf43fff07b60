"""Version 1 of the swarmgrad wire protocol (proto package `swarmgrad.v1`)."""
