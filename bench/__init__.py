"""relay benchmark harness: see bench/README.md."""
