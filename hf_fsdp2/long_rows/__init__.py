"""Long rows: the chunked loss and sequence parallelism (Ulysses attention)."""
