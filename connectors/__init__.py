"""Lower tiers (CPU arena, NVMe, Redis) and engine connectors. Knows nothing of policies."""
