"""The fragmentation analyzer behind ``kvtier bench fragmentation``."""
