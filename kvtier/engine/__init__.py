"""The reference engine: the engine loop, its async wrapper, the scheduler, the model
runner on the paged pool, chat sessions, sampling, and the offload/restore side of the
loop. "Engine" in kvtier means this and nothing else."""
