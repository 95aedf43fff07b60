"""Unit tests: no sockets, no processes beyond a tool run once (protoc, a schema check)."""
