"""Checkpoint builders for tests, benchmarks and the bundled models (tiny and real-shape)."""
