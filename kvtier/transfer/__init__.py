"""The data path between the paged pool and the lower tiers: snapshots and stores,
restores (layer by layer when streaming) and the background store queue."""
