"""Support shared by sntf's tests and benchmarks: graph corpora, workers,
fuzz generators. Nothing in the graph pass imports it."""
