"""Memory plans before launch: each rank's bytes in every phase."""
