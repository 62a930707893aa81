"""kvtier: tiered KV-cache offloading for multi-turn LLM serving.

Kept import-light on purpose: subpackages (``kvtier.gpu_pool``, ``kvtier.connectors`` ...)
import ``kvtier.errors`` and ``kvtier.config``, so nothing heavy may be imported here.
"""

__version__ = "0.1.0"
