"""batching core (plain torch)."""
