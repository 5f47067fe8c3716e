"""shardwise's tests; a package so that spawned harness workers can import test modules by name."""
