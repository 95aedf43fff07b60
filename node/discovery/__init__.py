"""Peer discovery: signed peer records in a DHT, behind one small async interface."""
