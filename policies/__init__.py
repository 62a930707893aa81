"""Offload, restore, eviction and prefetch decisions: pure logic over observed state and a cost model."""
