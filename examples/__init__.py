"""The example pipelines and the RFC-015 match scores (`make demo`), shipped as package data."""
