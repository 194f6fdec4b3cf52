"""pytest plugin: run the preflight suite on an adapter as a test (filled in by the preflight work)."""
