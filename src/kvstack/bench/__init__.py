"""Benchmarking: tasks (data generators), running, storing and reporting."""
