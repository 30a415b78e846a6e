"""Data-side tools: input-stall measurement and token-budget batching (plain torch)."""
