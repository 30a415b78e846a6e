"""checkpointing core (plain torch)."""
