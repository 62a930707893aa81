"""The lower tiers (CPU arena, disk directory, Redis), their chunk index and checks, and the
tier manager that stacks them. Bookkeeping and data movement, no policy choice: which chunk
to evict comes from an eviction policy passed in."""
