"""Refold's Avro schemas (events, checkpoints, dead letters, state), shipped as package data."""
